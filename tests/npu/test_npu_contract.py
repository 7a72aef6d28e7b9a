"""The fake torch_npu is held to every published torch_npu wheel the project supports (2.13.0 and 2.14.0): its ops
carry each wheel's schemas and meta rules, its modules define only names each wheel defines, and the project calls
only names each wheel defines."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest
import torch

from titan_npu.ops import npu as npu_ops

REPO = Path(__file__).resolve().parents[2]


def _normalised(schema: str) -> str:
    return str(torch._C.parse_schema(schema))


def test_every_op_of_the_fake_has_each_wheels_schema(fake_torch_npu, each_torch_npu_wheel):
    for name in (*fake_torch_npu.KERNELS, *fake_torch_npu.SCHEMA_ONLY):
        got = str(getattr(torch.ops.npu, name).default._schema).replace("npu::", "", 1)
        assert got == _normalised(each_torch_npu_wheel.op_schema(name)), name


def test_the_loaded_schemas_cover_the_attention_moe_and_context_parallel_ops(fake_torch_npu):
    loaded = {*fake_torch_npu.KERNELS, *fake_torch_npu.SCHEMA_ONLY}
    assert {"npu_fusion_attention", "npu_rms_norm", "npu_rotary_mul", "npu_swiglu", "npu_grouped_matmul",
            "npu_moe_init_routing_v2", "npu_moe_token_permute", "npu_moe_token_unpermute"} <= loaded
    # varlen attention (context parallelism) is npu_fusion_attention's actual_seq_qlen / actual_seq_kvlen
    args = {a.name for a in torch.ops.npu.npu_fusion_attention.default._schema.arguments}
    assert {"actual_seq_qlen", "actual_seq_kvlen", "sparse_mode"} <= args


def test_a_wrong_keyword_type_or_arity_fails_like_on_the_card(fake_torch_npu):
    x, w = torch.randn(2, 3, 8), torch.ones(8)
    with pytest.raises(RuntimeError, match="Unknown keyword argument 'eps'"):
        fake_torch_npu.npu_rms_norm(x, w, eps=1e-6)
    with pytest.raises(RuntimeError, match="Expected a value of type 'str' for argument 'rotary_mode'"):
        fake_torch_npu.npu_rotary_mul(torch.randn(1, 4, 2, 8), torch.ones(1, 4, 1, 8), torch.ones(1, 4, 1, 8), 1)
    assert len(fake_torch_npu.npu_rms_norm(x, w, epsilon=1e-6)) == 2  # (y, rstd), as the schema returns
    assert len(fake_torch_npu.npu_fusion_attention(x[None], x[None], x[None], 3, "BSND")) == 7


def test_an_op_without_a_cpu_kernel_is_defined_but_not_callable(fake_torch_npu):
    with pytest.raises(NotImplementedError):
        fake_torch_npu.npu_moe_init_routing_v2(torch.randn(4, 8), torch.zeros(4, 1, dtype=torch.int32))


def test_a_result_that_differs_from_the_wheels_meta_function_is_refused(each_torch_npu_wheel):
    x = torch.randn(2, 3, 8)
    each_torch_npu_wheel.check_against_meta("npu_swiglu", (x,), {"dim": -1}, x[..., :4])
    with pytest.raises(RuntimeError, match="meta function gives"):
        each_torch_npu_wheel.check_against_meta("npu_swiglu", (x,), {"dim": -1}, x)  # not halved along dim
    with pytest.raises(RuntimeError, match="1 outputs"):
        each_torch_npu_wheel.check_against_meta("npu_rms_norm", (x, torch.ones(8)), {"epsilon": 1e-6}, x)


def test_the_fakes_public_names_are_names_each_wheel_defines(fake_torch_npu, each_torch_npu_wheel):
    for module, wheel_module in ((fake_torch_npu.npu, "torch_npu.npu"), (fake_torch_npu.profiler, "torch_npu.profiler"),
                                 (fake_torch_npu.optim, "torch_npu.optim")):
        defined = {n for n, v in vars(module).items() if not n.startswith("_")
                   and (inspect.isfunction(v) or inspect.isclass(v)) and v.__module__ == module.__name__}
        missing = sorted(defined - each_torch_npu_wheel.module_names(wheel_module))
        version = each_torch_npu_wheel.version
        assert not missing, f"{wheel_module}: the fake defines {missing}, torch_npu {version} does not"


# torch_npu.<name>, torch.npu.<name>, `from torch_npu[.sub] import name` in the project's sources.

_FROM_IMPORT = re.compile(r"from torch_npu(\.\w+)? import ([\w, ]+)")


def project_torch_npu_names() -> set[tuple[str, str]]:
    """(module, name) for every torch_npu attribute the project's code refers to by name."""
    found: set[tuple[str, str]] = set()
    for path in (REPO / "titan_npu").rglob("*.py"):
        for line in path.read_text().splitlines():
            code = line.split("#", 1)[0].replace("_torch_npu()", "torch_npu")  # ops/npu.py's import helper
            for m in _FROM_IMPORT.finditer(code):
                module = "torch_npu" + (m.group(1) or "")
                found.update((module, n.split(" as ")[0].strip()) for n in m.group(2).split(",") if n.strip())
            for m in re.finditer(r"\btorch\.npu\.([A-Za-z_]\w*)", code):
                found.add(("torch_npu.npu", m.group(1)))
            for m in re.finditer(r"\btorch\.ops\.npu\.([A-Za-z_]\w*)", code):  # ops the wheel does not expose
                found.add(("torch_npu", m.group(1)))
            for m in re.finditer(r"\btorch_npu\.([A-Za-z_]\w*)(?:\.([A-Za-z_]\w*))?", code):
                first, second = m.groups()
                if first in ("npu", "profiler", "optim") and second:
                    found.add((f"torch_npu.{first}", second))
                elif first not in ("npu", "profiler", "optim"):
                    found.add(("torch_npu", first))
    return found


def test_the_project_calls_only_torch_npu_names_each_wheel_defines(each_torch_npu_wheel):
    wheel = each_torch_npu_wheel
    names = project_torch_npu_names()
    assert ("torch_npu", "npu_fusion_attention") in names  # the scan sees the kernels' calls
    assert ("torch_npu", "npu_sparse_flash_attention_grad") in names  # and those through torch.ops.npu
    unknown = []
    for module, name in sorted(names):
        if module == "torch_npu":
            # _C is the compiled extension (its names are not in the wheel's Python files)
            known = name in wheel.op_names() or name in ("npu", "profiler", "optim", "_C", "__version__")
        else:
            known = name in wheel.module_names(module)
        if not known:
            unknown.append(f"{module}.{name}")
    assert not unknown, f"the project calls {unknown}, which torch_npu {wheel.version} lacks"


def test_every_rule_the_fake_encodes_cites_words_the_wheel_contains(fake_torch_npu, each_torch_npu_wheel):
    missing = [key for key, (relative, words) in fake_torch_npu.CITED.items()
               if words not in each_torch_npu_wheel.read(relative)]
    assert not missing, f"cited words not in the pinned wheel: {missing}"


def test_every_error_a_fake_kernel_raises_for_a_documented_rule_names_its_source(fake_torch_npu):
    # The fake's kernels refuse what the card refuses: each RuntimeError carries cite(<key of CITED>).
    tree = ast.parse(Path(fake_torch_npu.__file__).read_text())
    uncited = []
    for function in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        for node in ast.walk(function):
            if (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                    and getattr(node.exc.func, "id", None) == "RuntimeError"):
                cited = [c for c in ast.walk(node.exc)
                         if isinstance(c, ast.Call) and getattr(c.func, "id", None) == "cite"]
                if not cited or any(c.args[0].value not in fake_torch_npu.CITED for c in cited
                                    if isinstance(c.args[0], ast.Constant)):
                    uncited.append(f"{function.name}:{node.lineno}")
    assert not uncited, f"RuntimeErrors without a cited source: {uncited}"


# The ops ops/npu.py runs on DTensors' local shards, and the wheel's sharding rule for each kernel it calls there.
SHARD_RULES = {
    "npu_rms_norm": ("torch_npu/distributed/tensor/_math_ops.py", "@register_op_strategy(npu.npu_rms_norm.default)"),
    "npu_rotary_mul": ("torch_npu/distributed/tensor/_math_ops.py", "@register_sharding(npu.npu_rotary_mul.default)"),
    "npu_swiglu": ("torch_npu/distributed/tensor/_math_ops.py", "@register_sharding(npu.npu_swiglu.default)"),
    "npu_fusion_attention": ("torch_npu/distributed/tensor/_attention.py",
                             "@register_sharding(npu.npu_fusion_attention.default)"),
}


def test_the_kernels_run_on_dtensor_shards_are_those_the_wheel_shards(each_torch_npu_wheel):
    for kernel, (relative, rule) in SHARD_RULES.items():
        assert rule in each_torch_npu_wheel.read(relative), kernel
    # rotary: the wheel shards any dim but D, keeping r1/r2 whole where they have size 1 (batch and heads of 1S1D);
    # attention: batch and heads, and nothing for varlen (ops/npu.py keeps the batch whole with documents)
    assert "if r1.shape[i] == 1:" in each_torch_npu_wheel.read(SHARD_RULES["npu_rotary_mul"][0])
    assert "unused_args_in_sdpa = [pse, padding_mask, prefix, actual_seq_qlen, actual_seq_kvlen, sink]" in \
        each_torch_npu_wheel.read(SHARD_RULES["npu_fusion_attention"][0])


def test_the_npu_kernels_call_through_the_wheels_schemas(fake_torch_npu):
    fake_torch_npu.calls.clear()
    x = torch.randn(1, 6, 2, 8)
    npu_ops.attention(x, x, x)
    npu_ops.rms_norm(x, torch.ones(8), 1e-6)
    cos, sin = torch.ones(6, 4), torch.zeros(6, 4)
    npu_ops.apply_rotary_emb(x, x, cos, sin)
    npu_ops.swiglu(x, x)
    assert set(fake_torch_npu.calls) == {"npu_fusion_attention", "npu_rms_norm", "npu_rotary_mul", "npu_swiglu"}


# torch_npu.profiler as the project calls it: (fake object, wheel file, the wheel's name for it)
PROFILER_API = [
    ("profile", "torch_npu/profiler/profiler.py", "profile"),
    ("tensorboard_trace_handler", "torch_npu/profiler/profiler.py", "tensorboard_trace_handler"),
    ("schedule", "torch_npu/profiler/scheduler.py", "Schedule"),  # the package exports Schedule as schedule
    ("_ExperimentalConfig", "torch_npu/profiler/experimental_config.py", "_ExperimentalConfig"),
]


@pytest.mark.parametrize("name,relative,real", PROFILER_API, ids=[p[0] for p in PROFILER_API])
def test_the_fake_profiler_accepts_only_what_each_wheels_accepts(fake_torch_npu, each_torch_npu_wheel, name, relative,
                                                                 real):
    fake = getattr(fake_torch_npu.profiler, name)
    real_params = dict(each_torch_npu_wheel.parameters(relative, real))
    target = fake.__init__ if inspect.isclass(fake) else fake
    for p in inspect.signature(target).parameters.values():
        if p.name == "self" or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        assert p.name in real_params, f"torch_npu.profiler.{name} has no parameter {p.name!r}"
        if real_params[p.name] == "keyword_only":
            assert p.kind == p.KEYWORD_ONLY, f"torch_npu.profiler.{name}: {p.name!r} is keyword-only there"


@pytest.mark.parametrize("name", ["ProfilerLevel", "AiCMetrics", "ExportType"])
def test_the_fake_profiler_constants_are_each_wheels(fake_torch_npu, each_torch_npu_wheel, name):
    fake = {n for n in vars(getattr(fake_torch_npu.profiler, name)) if not n.startswith("_")}
    assert fake <= each_torch_npu_wheel.class_attributes("torch_npu/profiler/experimental_config.py", name)


# DeepSeek Sparse Attention: the keywords ops/npu.py passes, and the outputs it reads, in each wheel's schema.
DSA_CALLS = {
    "npu_lightning_indexer": ({"layout_query", "layout_key", "sparse_count", "sparse_mode"}, 2),
    "npu_sparse_flash_attention": ({"sparse_block_size", "layout_query", "layout_kv", "sparse_mode",
                                    "return_softmax_lse"}, 3),
    "npu_sparse_flash_attention_grad": ({"layout", "sparse_mode"}, 5),
    "npu_dense_lightning_indexer_softmax_lse": ({"layout", "sparse_mode"}, 2),
    "npu_dense_lightning_indexer_grad_kl_loss": ({"query_rope", "key_rope", "layout", "sparse_mode"}, 4),
}


@pytest.mark.parametrize("op", list(DSA_CALLS))
def test_the_dsa_kernels_take_the_keywords_and_return_the_outputs_the_project_uses(each_torch_npu_wheel, op):
    schema = torch._C.parse_schema(each_torch_npu_wheel.op_schema(op))
    keywords, outputs = DSA_CALLS[op]
    assert keywords <= {a.name for a in schema.arguments}
    assert len(schema.returns) == outputs
    if op != "npu_sparse_flash_attention_grad":  # the grad op takes them positionally or by name
        assert all(a.kwarg_only for a in schema.arguments if a.name in keywords)
