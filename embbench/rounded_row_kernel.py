"""The rounded-row update kernel of :mod:`embbench.row_update` and its helpers (Triton; a module
of its own so that triton is imported only when a rounded store first updates through it).

Each helper mirrors its torch counterpart operation for operation so that the stored bits are
torch's: :func:`mix` is :func:`embbench.row_precision._mix`, :func:`stochastic_round` is
:func:`embbench.row_precision.stochastic_round`, :func:`decode` and :func:`encode` are
:meth:`~embbench.row_precision.RowType.decode` and ``encode``'s type conversion on the stored bits
(int16 for fp16 and bf16, uint8 for fp8 E4M3), and the step is
:func:`embbench.row_update.stepped_rows`.
"""

import triton
import triton.language as tl


@triton.jit
def mix(x):  # row_precision._mix: splitmix64's finaliser on int64, shifts made logical by masks
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * -4658895280553007687
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * -7723592293110705685
    return x ^ ((x >> 31) & ((1 << 33) - 1))


@triton.jit
def pow2(p):  # 2.0 ** p for int32 p in [-126, 127], exactly
    return ((p + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def decode(bits, FORMAT: tl.constexpr):  # stored bits (int16, or uint8 for fp8) as float32, exactly
    if FORMAT == 0:
        value = bits.to(tl.float16, bitcast=True).to(tl.float32)
    elif FORMAT == 1:
        value = ((bits.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:  # E4M3: exponent bias 7, subnormals m * 2^-9
        b = bits.to(tl.int32)
        e, m = (b >> 3) & 15, b & 7
        magnitude = tl.where(e == 0, m.to(tl.float32) * 0.001953125,
                             (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True))
        value = tl.where((b & 128) != 0, -magnitude, magnitude)
    return value


@triton.jit
def encode(r, FORMAT: tl.constexpr):  # float32 values the format holds exactly, as its bits
    b = r.to(tl.int32, bitcast=True)
    if FORMAT == 0:
        bits = r.to(tl.float16).to(tl.int16, bitcast=True)
    elif FORMAT == 1:
        bits = (b >> 16).to(tl.int16)  # the low half is zero
    else:
        a = tl.abs(r)
        normal = ((((b >> 23) & 255) - 120) << 3) | ((b >> 20) & 7)
        code = tl.where(a >= 0.015625, normal, (a * 512.0).to(tl.int32))
        bits = (code | ((b >> 24) & 128)).to(tl.uint8)
    return bits


@triton.jit
def stochastic_round(x, u, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr, max_value):
    # row_precision.stochastic_round: x / spacing and back by powers of two in two
    # exact factors each (bf16's spacing reaches 2^-133, below float32's normal range)
    e = ((x.to(tl.int32, bitcast=True) >> 23) & 255) - 127
    p = MANTISSA - tl.maximum(e, MIN_EXP)
    p1 = p >> 1
    p2 = p - p1
    scaled = x * pow2(p1) * pow2(p2)
    low = tl.floor(scaled)
    r = (low + (u < scaled - low).to(tl.float32)) * pow2(-p1) * pow2(-p2)
    return tl.where(r > max_value, max_value, tl.where(r < -max_value, -max_value, r))  # NaN stays


@triton.jit
def update_rounded_rows(weights, w_stride, extras, x_stride, rows, keys, grads, distinct, n, dim, lr, eps,
                        key, max_value, ADAGRAD: tl.constexpr, FORMAT: tl.constexpr, MANTISSA: tl.constexpr,
                        MIN_EXP: tl.constexpr, SCALED: tl.constexpr, ROWS: tl.constexpr, LANES: tl.constexpr):
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = (i < n) & (i < tl.load(distinct))  # the padding: no load, no store
    row = tl.load(rows + i, mask=live, other=0).to(tl.int64)
    entry = i.to(tl.int64) * dim
    lane = tl.arange(0, LANES)
    zeros = tl.zeros([ROWS], dtype=tl.float32)
    # float32 as compiled code takes float arguments (the interpreter would compute in float64)
    lr, eps, top = (zeros + lr).to(tl.float32), (zeros + eps).to(tl.float32), (zeros + max_value).to(tl.float32)
    if ADAGRAD:  # state += sum(g^2) / dim; rate = lr / (sqrt(state) + eps)
        lanes = tl.zeros([ROWS, LANES], dtype=tl.float32)
        for c0 in range(0, dim, LANES):
            c = c0 + lane
            g = tl.load(grads + entry[:, None] + c[None, :], mask=live[:, None] & (c < dim)[None, :], other=0.0)
            lanes = lanes + g * g
        squares = zeros
        for j in tl.static_range(LANES):  # lane by lane (a sum of one value and zeros is exact)
            squares = squares + tl.sum(tl.where(lane[None, :] == j, lanes, 0.0), axis=1)
        state = extras + row * x_stride + (1 if SCALED else 0)  # after the scale (a bool offset: -1 as i1)
        acc = tl.load(state, mask=live, other=0.0) + tl.math.div_rn(squares, zeros + dim)
        tl.store(state, acc, mask=live)
        rate = tl.math.div_rn(lr, tl.math.sqrt_rn(acc) + eps)
    else:
        rate = zeros + lr
    old_scale = zeros + 1.0
    new_scale = zeros + 1.0
    if SCALED:  # fp8: the row's new scale is its largest new |w| / max_value
        old_scale = tl.load(extras + row * x_stride, mask=live, other=1.0)
        amax = zeros
        for c0 in range(0, dim, LANES):
            c = c0 + lane
            mask = live[:, None] & (c < dim)[None, :]
            g = tl.load(grads + entry[:, None] + c[None, :], mask=mask, other=0.0)
            w = decode(tl.load(weights + row[:, None] * w_stride + c[None, :], mask=mask, other=0), FORMAT)
            w = w * old_scale[:, None] - g * rate[:, None]
            amax = tl.maximum(amax, tl.max(tl.where(mask, tl.abs(w), 0.0), axis=1))
        new_scale = tl.where(amax > 0, tl.math.div_rn(amax, top), 1.0)
        tl.store(extras + row * x_stride, new_scale, mask=live)
    per_row = mix(tl.load(keys + i, mask=live, other=0).to(tl.int64) * 0x9E3779B1 + key)
    for c0 in range(0, dim, LANES):
        c = c0 + lane
        mask = live[:, None] & (c < dim)[None, :]
        g = tl.load(grads + entry[:, None] + c[None, :], mask=mask, other=0.0)
        at = weights + row[:, None] * w_stride + c[None, :]
        w = decode(tl.load(at, mask=mask, other=0), FORMAT)
        if SCALED:
            w = w * old_scale[:, None]
        w = w - g * rate[:, None]
        if SCALED:
            w = tl.math.div_rn(w, new_scale[:, None] + tl.zeros([ROWS, LANES], dtype=tl.float32))
            w = tl.where(w > top[:, None], top[:, None], tl.where(w < -top[:, None], -top[:, None], w))
        bits = mix(per_row[:, None] + c[None, :])
        u = ((bits >> 40) & ((1 << 24) - 1)).to(tl.float32) * (1.0 / (1 << 24))
        tl.store(at, encode(stochastic_round(w, u, MANTISSA, MIN_EXP, top[:, None]), FORMAT), mask=mask)
