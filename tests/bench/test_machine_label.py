"""bench/machine_label.py: the GPU benchmarks' result files name the card the run found."""
from bench.machine_label import machine_label


def test_auto_names_the_card_model():
    assert machine_label("auto", "NVIDIA H100 80GB HBM3") == "h100"
    assert machine_label("auto", "NVIDIA H200") == "h200"
    assert machine_label("auto", "NVIDIA A100-SXM4-40GB") == "a100"
    assert machine_label("auto", "NVIDIA GH200 480GB") == "gh200"
    assert machine_label("auto", "NVIDIA L40S") == "l40s"


def test_an_unreadable_name_or_an_explicit_label():
    assert machine_label("auto", None) == "gpu"
    assert machine_label("auto", "Some Accelerator") == "gpu"
    assert machine_label("h100-pcie", "NVIDIA H200") == "h100-pcie"
