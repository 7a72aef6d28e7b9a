"""How ops choose an implementation: per device type, per op, with the reference filling every gap."""

import pytest
import torch

from titan_npu import ops
from titan_npu.errors import ConfigError
from titan_npu.ops import dispatch, reference


@pytest.fixture(autouse=True)
def _isolated_registry():
    """Each test starts from the shipped registry in auto mode and leaves it that way."""
    ops.available_backends()  # imports the shipped vendor backends first, so the snapshot holds them
    saved = dict(dispatch._backends)
    ops.set_kernels("auto")
    yield
    dispatch._backends.clear()
    dispatch._backends.update(saved)
    ops.set_kernels("auto")


def _doubling_swiglu(gate, up):
    return 2 * reference.swiglu(gate, up)


def test_cpu_uses_its_backend_for_linear_attention_and_the_router_and_the_reference_for_the_rest():
    on_cpu = ("linear", "attention", "moe_topk_softmax")
    assert ops.current_kernels("cpu") == {op: "cpu" if op in on_cpu else "reference" for op in ops.OP_NAMES}


def test_a_device_without_a_registered_backend_falls_back_to_the_reference():
    assert set(ops.current_kernels("meta").values()) == {"reference"}
    assert set(ops.current_kernels("testdev").values()) == {"reference"}


def test_auto_picks_the_backend_named_after_the_device_type_for_the_ops_it_provides():
    ops.register_backend("testdev", {"swiglu": _doubling_swiglu})
    assert ops.current_kernels("testdev") == {op: "testdev" if op == "swiglu" else "reference" for op in ops.OP_NAMES}
    assert ops.current_kernels("cpu")["swiglu"] == "reference"


def test_calls_go_to_the_chosen_backend():
    gate, up = torch.randn(4), torch.randn(4)
    ops.register_backend("cpu", {"swiglu": _doubling_swiglu})
    torch.testing.assert_close(ops.swiglu(gate, up), 2 * reference.swiglu(gate, up))
    ops.set_kernels("reference")
    torch.testing.assert_close(ops.swiglu(gate, up), reference.swiglu(gate, up))


def test_a_named_backend_applies_to_every_device_type():
    ops.register_backend("mine", {"rms_norm": reference.rms_norm})
    ops.set_kernels("mine")
    assert ops.current_kernels("cpu")["rms_norm"] == "mine"
    assert ops.current_kernels("testdev")["rms_norm"] == "mine"
    assert ops.current_kernels("cpu")["attention"] == "reference"


def test_per_op_override_keeps_the_other_fused_kernels():
    ops.register_backend("testdev", {"attention": reference.attention, "swiglu": reference.swiglu})
    ops.set_kernels("auto", attention="reference")
    kernels = ops.current_kernels("testdev")
    assert kernels["attention"] == "reference" and kernels["swiglu"] == "testdev"


def test_registering_a_backend_takes_effect_after_earlier_lookups():
    assert ops.current_kernels("cpu")["swiglu"] == "reference"
    ops.register_backend("cpu", {"swiglu": _doubling_swiglu})
    assert ops.current_kernels("cpu")["swiglu"] == "cpu"


def test_use_flash_false_always_runs_the_eager_baseline():
    calls = []

    def counting_attention(q, k, v, *, causal=True):
        calls.append(causal)
        return reference.attention(q, k, v, causal=causal)

    ops.register_backend("cpu", {"attention": counting_attention})
    q = torch.randn(1, 4, 2, 8)
    ops.attention(q, q, q, use_flash=False)
    assert calls == []
    ops.attention(q, q, q, use_flash=True)
    assert calls == [True]


def test_unknown_kernels_name_is_a_config_error_listing_the_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown kernels 'fused' \(valid: auto, .*reference"):
        ops.set_kernels("fused")
    with pytest.raises(ConfigError, match="unknown op 'softmax'"):
        ops.set_kernels("auto", softmax="reference")


def test_per_op_override_to_a_backend_lacking_that_op_is_refused():
    ops.register_backend("partial", {"swiglu": reference.swiglu})
    with pytest.raises(ConfigError, match="'partial' has no 'attention' kernel"):
        ops.set_kernels("auto", attention="partial")


def test_register_backend_rejects_unknown_ops_and_reserved_names():
    with pytest.raises(ValueError, match="unknown ops"):
        ops.register_backend("x", {"flash_attention": reference.attention})
    with pytest.raises(ValueError, match="reserved"):
        ops.register_backend("reference", {})
    with pytest.raises(ValueError, match="not callable"):
        ops.register_backend("x", {"swiglu": "silu"})


def test_available_backends_lists_registered_names():
    assert "mine" not in ops.available_backends()
    ops.register_backend("mine", {})
    names = ops.available_backends()
    assert names[0] == "auto" and {"mine", "reference"} <= set(names)
