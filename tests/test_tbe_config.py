"""fbgemm's TBE input reports (the JSON FBGEMM_REPORT_INPUT_PARAMS_INTERVAL writes), written here
in their format, as a scenario's synthetic data."""

import json

import pytest

from embbench.data.tbe_config import read_tbe_report, synthetic_data
from embbench.scenario import DataConfig


def _report(tmp_path, **changes):
    """A report with every field fbgemm 1.8's TBEDataConfig.dict() writes (its reporter's
    json.dumps(config.dict()); fbgemm's bench module itself needs click, not installed here)."""

    def fit(s):
        return {"heavy_hitters": [0.2, 0.1], "zipf_q": 0.5, "zipf_s": s, "index_dtype": "torch.int64",
                "offset_dtype": "torch.int64"}

    raw = {"T": 2, "E": 1000, "D": 16, "mixed_dim": False, "weighted": False,
           "batch_params": {"B": 512, "sigma_B": None, "vbe_distribution": None, "vbe_num_ranks": None, "Bs": None},
           "indices_params": fit(1.1),
           "pooling_params": {"L": 2, "sigma_L": 1, "length_distribution": "normal", "Ls": [1.0, 3.2]},
           "use_cpu": False, "Es": [1000, 300], "Ds": [16, 16], "max_indices": 999, "embedding_specs": [[1000, 16], [300, 16]],
           "feature_table_map": [0, 1], "indices_params_list": [fit(1.05), fit(0.8)], **changes}
    path = tmp_path / "tbe-op-config-estimation-100.json"
    path.write_text(json.dumps(raw, indent=2))
    return path


def test_a_report_becomes_a_valid_synthetic_section(tmp_path):
    data = synthetic_data(read_tbe_report(_report(tmp_path)))
    assert data == {"source": "synthetic", "embedding_dim": 16, "batch_size": 512,
                    "tables": [{"rows": 1000, "alpha": 1.05, "bag_size": 1}, {"rows": 300, "alpha": 0.8, "bag_size": 3}]}
    DataConfig(**data)  # a scenario takes it as it is


@pytest.mark.parametrize("changes, message", [
    ({"T": 3}, "Es has 2 entries for T = 3 tables"),
    ({"batch_params": {"B": 0}}, "batch_params.B: Input should be greater than 0"),
    ({"indices_params": {"zipf_q": 0.5}}, "indices_params.zipf_s: Field required"),
    ({"Ds": [16, 32]}, None),
])
def test_damaged_reports_are_refused_naming_file_and_key(tmp_path, changes, message):
    path = _report(tmp_path, **changes)
    if message is None:  # readable, but embbench's tables share one dim
        with pytest.raises(ValueError, match="dims \\[16, 32\\]"):
            synthetic_data(read_tbe_report(path))
        return
    with pytest.raises(ValueError, match=f"{path}: " + message.replace("(", r"\(").replace(")", r"\)")):
        read_tbe_report(path)


def test_a_file_that_is_not_json_is_refused(tmp_path):
    path = tmp_path / "tbe.json"
    path.write_text('{"T": 2,')
    with pytest.raises(ValueError, match=f"{path}: not valid JSON \\(line 1\\)"):
        read_tbe_report(path)


def test_import_command_prints_the_section(tmp_path, capsys):
    import yaml

    from embbench.cli import main

    assert main(["data", "import-tbe", str(_report(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"# from {tmp_path}") and "heavy hitters are not reproduced" in out
    assert yaml.safe_load(out)["data"]["tables"][1] == {"rows": 300, "alpha": 0.8, "bag_size": 3}
    assert main(["data", "import-tbe", str(_report(tmp_path, T=3))]) == 2
    assert "Es has 2 entries for T = 3 tables" in capsys.readouterr().err
