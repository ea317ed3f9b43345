"The bandwidth a benchmark's decode bound divides by: the data sheet of the GPU that ran it, never another card's."
import pytest
import benchmarks.common as common


@pytest.mark.parametrize("name, expected", [("NVIDIA H200", 4.8e12), ("NVIDIA H100 80GB HBM3", 3.35e12),
                                            ("NVIDIA H100 PCIe", 2.0e12), ("NVIDIA H100 NVL", 3.9e12)])
def test_bandwidth_is_the_data_sheet_of_the_card_that_ran(monkeypatch, name, expected):
    monkeypatch.setattr(common, "gpu_name", lambda device=None: name)
    bandwidth, source = common.hbm_bytes_per_s("cuda")
    assert bandwidth == expected and source == f"data sheet ({name})"
