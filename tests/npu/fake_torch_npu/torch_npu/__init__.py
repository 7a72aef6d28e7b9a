"""A stand-in for torch_npu that runs on the CPU, for tests on machines without an Ascend NPU.

Its ops are defined with the schemas of the pinned torch_npu wheel (npu_wheel.py, fetched once and cached): a call
with an argument name, type or default the real op does not have fails in the dispatcher exactly as it would on a
card, and every result is checked against the wheel's meta function (arity, shapes, dtypes). The CPU kernels
follow the API reference -- input layouts, mask convention (True = masked out), sparse modes, scale, dtype rules,
shape limits -- in plain torch, so autograd gives the backward, and reject what the real kernel rejects.

Importing it does what the real package does to torch: it attaches the `torch.npu` device namespace. Installed with
the wheel's dist-info (npu_wheel.Wheel.write_dist_info), `import torch` imports it through the wheel's
torch.backends entry point, as it imports the real package. Which
kernels ran is counted in `calls` so tests can prove that the NPU path was taken. Two switches serve tests that
run a whole program in a subprocess: FAKE_NPU_TENSORS=1 makes "npu" a real torch device (tensors backed by CPU
memory, see _device.py) and FAKE_TORCH_NPU_REPORT=<file> writes the calls, the environment seen at import, at
device binding and at each HCCL group's creation, the HCCL timeouts and the device requests to <file> at exit
(with FAKE_NPU_TENSORS=1, "hccl" is a process-group backend for the fake device, _hccl.py).
"""

from __future__ import annotations

import collections
import os
import sys

import npu_wheel
import torch
import torch.nn.functional as F

# The environment as the real package reads it: the allocator, task queue and runtime settings at import.
_ENV_PREFIXES = ("HCCL_", "PYTORCH_NPU_", "PYTORCH_ALLOC_CONF", "GLOO_SOCKET", "TASK_QUEUE_ENABLE", "CPU_AFFINITY_CONF",
                 "STREAMS_PER_DEVICE", "TORCH_HCCL_", "CLOSE_MATMUL_K_SHIFT", "ASCEND_")
events: list[tuple[str, dict[str, str]]] = []  # (what happened, the relevant environment at that moment)


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}


def _record_event(what: str) -> None:
    """Remember that `what` happened (import, set_device, hccl_init) and the environment the runtime saw then,
    with torch's deterministic-algorithms switch."""
    env = _environment()
    env["deterministic_algorithms"] = str(torch.are_deterministic_algorithms_enabled())
    events.append((what, env))


_record_event("import")


def _autoload() -> None:
    """The wheel's torch.backends entry point (its entry_points.txt: `torch_npu = torch_npu:_autoload`), which
    `import torch` calls once it has imported this package (torch_npu/__init__.py:67-71: "an entrypoint called by
    PyTorch when running 'import torch'"). Recorded, so that a test sees torch import the package."""
    _record_event("autoload")


from torch_npu import npu, optim, profiler  # noqa: E402, F401  (submodules, as in the real package)

# The real package is versioned "<torch X.Y.Z>[.postN]"; FAKE_TORCH_NPU_VERSION lets a test pretend otherwise.
__version__ = os.environ.get("FAKE_TORCH_NPU_VERSION") or npu_wheel.TORCH_NPU_VERSION

calls: collections.Counter = collections.Counter()


def _write_report(path: str) -> None:
    """What the process asked of torch_npu, for a test that ran it in a subprocess."""
    import json

    report = {"calls": dict(calls), "env": _environment(), "events": events,
              "set_device_calls": npu.state["set_device_calls"], "memory_fraction": npu.state["memory_fraction"],
              "empty_cache_calls": npu.state["empty_cache_calls"],
              "deterministic": torch.are_deterministic_algorithms_enabled(),
              "hccl_timeouts": sys.modules["torch_npu._hccl"].timeouts if "torch_npu._hccl" in sys.modules else []}
    with open(path, "w") as f:
        json.dump(report, f)


if os.environ.get("FAKE_TORCH_NPU_REPORT"):
    import atexit

    # "{rank}" in the path: one report per rank of a torchrun job
    atexit.register(_write_report, os.environ["FAKE_TORCH_NPU_REPORT"].replace("{rank}", os.environ.get("RANK", "0")))

if os.environ.get("FAKE_NPU_TENSORS") == "1":
    from torch_npu import _device, _hccl

    _device.install(npu)  # registers torch.npu, as the real package does
    _hccl.install()
else:
    torch.npu = npu

# --- where each documented behaviour of the kernels below comes from -----------------------------------------------
# Every rule the kernels encode beyond the schema and the meta function (index conventions, dtypes, group types,
# length caps) names its source here: the wheel file and the words in it, which test_npu_contract.py finds in the
# pinned wheel. Where the API reference contradicts itself the stricter reading is encoded (the other one is noted).
DOCS = "torch_npu/_op_plugin_docs.py"
META = npu_wheel.META_FILE
CITED: dict[str, tuple[str, str]] = {
    # npu_fusion_attention
    "fa.layout": (DOCS, "支持BSH、SBH、BSND、BNSD、TND(actual_seq_qlen/actual_seq_kvlen需传值)"),
    "fa.dtype": (DOCS, "输入query、key、value、pse的数据类型必须一致."),
    "fa.mask": (DOCS, "取值为1(或True)代表该位不参与计算(被遮蔽), 取值为0(或False)代表该位参与计算(被保留), "
                      "数据类型支持bool、uint8"),
    "fa.mask_shape": (DOCS, "输入shape类型支持BNSS格式、B1SS格式、11SS格式、SS格式"),
    "fa.compressed_mask": (DOCS, "传入的atten_mask为优化后的压缩下三角矩阵(2048*2048)"),
    "fa.head_num": (DOCS, "head_num: int类型, 代表head个数"),
    "fa.key_value": (DOCS, "1. 输入key和value的shape必须一致."),
    "fa.gqa": (DOCS, "Nq/Nkv必须是非0整数"),
    "fa.cumulative": (DOCS, "表示query每个S的累加和长度"),
    # "varlen场景B取值范围1~2K" on the line before says 2K; the stricter 1K is encoded.
    "fa.varlen_max": (DOCS, "actual_seq_qlen的长度取值范围为1~2K, varlen场景下长度最大支持1K."),
    "fa.softmax_stats": (META, "def npu_fusion_attention_forward"),
    # npu_rms_norm
    "rms.dtype": (DOCS, "self：Tensor类型，支持float16、bfloat16、float32"),
    "rms.gamma": (DOCS, "gamma：Tensor类型，数据类型需要和self保持一致，输入shape支持2-8维，通常为self的最后一维。"),
    # npu_rotary_mul
    "rope.mode": (DOCS, "支持'half'、'interleave'两种模式"),
    "rope.dims": (DOCS, "input：必选输入，4维Tensor"),
    "rope.table_dtype": (META, "dr1 = torch.empty_like(cosine, dtype=embedding.dtype, device='meta')"),
    "rope.half": (DOCS, "D < 896，且为2的倍数; B, N < 1000"),
    "rope.half_tables": (DOCS, "input为BSND: 1S1D、BS1D、BSND;"),
    "rope.interleave": (DOCS, "B * N < 1000; D < 896, 且D为2的倍数;"),
    "rope.interleave_tables": (DOCS, "input为BSND: 1S1D;"),
    # npu_swiglu
    "swiglu.halves": (DOCS, "“A”和“B”是x沿dim维度切分的Tensor。"),
    # npu_grouped_matmul, the non-quantised single-tensor case (group_type 0, one x, one weight, one y)
    "gmm.dtype": (DOCS, "x: torch.float16, torch.bfloat16, torch.float32"),
    "gmm.group_list": (DOCS, "表示x的第0维矩阵乘法的索引情况. 数据类型支持torch.int64."),
    "gmm.group_list_type": (DOCS, "可取值0或1, 0代表group_list_type中数值为分组轴大小的cumsum结果(累积和)"),
    "gmm.monotone": (DOCS, "当group_list_type为0时, group_list必须为非负单调非递减数列."),
    "gmm.inner_limit": (DOCS, "的内轴限制InnerLimit为65536. x和weight中每一组tensor的最后一维大小都应小于InnerLimit."),
    "gmm.group_type": (DOCS, "Atlas A2 训练系列产品/Atlas 800I A2 推理产品: 当前支持取-1、0."),
    "gmm.single": (DOCS, "0: 仅支持split_item为2或3. weight中tensor需为3维, x、y中tensor需为2维. 必须传group_list, "
                         "且当group_list_type为0时, 最后一个值与x中tensor的第一维相等"),
    "gmm.max_groups": (DOCS, "group_list第1维最大支持1024, 即最多支持1024个group. 支持weight转置. x不支持转置."),
    # npu_grouped_matmul_add_ (K-axis groups: the weight gradient)
    "gmma.dtype": (DOCS, "支持的输入类型组合: x为float16、weight为float16、self为float32; "
                         "x为bfloat16、weight为bfloat16、self为float32."),
    "gmma.transpose": (DOCS, "x必须转置(transpose_x仅支持True), weight不支持转置(transpose_weight仅支持False)."),
    "gmma.group_type": (DOCS, "group_type当前仅支持2(K轴分组)."),
    "gmma.self": (DOCS, "shape为[g, M, N], 其中g为分组个数. 数据类型支持float32"),
    "gmma.group_list": (DOCS, "group_list须为非负单调非递减数列, 最后一个值不大于x中tensor的第一维"),
    "gmma.max_groups": (DOCS, "表示输入和输出分组轴方向的matmul大小分布, 必选参数. 数据类型支持int64, 数据格式支持ND. "
                              "第1维最大支持1024, 即最多支持1024个group."),
    "gmma.inner_limit": (DOCS, "x和weight中每一组tensor的最后一维大小都应小于65536."),
    # npu_moe_gating_top_k_softmax
    "gating.x": (DOCS, "表示待计算的输入要求是一个2D/3D的Tensor, 数据类型支持float16、bfloat16、float32"),
    "gating.k": (DOCS, "大小为0<k<=x的-1轴大小, k<=1024."),
    # npu_moe_token_permute / npu_moe_token_unpermute. The API reference documents each twice; the later entry (the
    # docstring that stays) states the index convention; the earlier one's example, sorted_indices
    # [0, 6, 7, 5, 3, 1, 2, 4], is the other convention (the stable argsort) -- the later one is encoded.
    "permute.convention": (DOCS, "即permuted_tokens[sorted_indices[i]] = tokens[i//topK]"),
    "permute.example": (DOCS, "sorted_indices = torch.tensor([0, 4, 5, 1, 2, 6, 7, 3], dtype=torch.int32).npu()"),
    "permute.earlier_example": (DOCS, "sorted_indices = torch.tensor([0, 6, 7, 5, 3, 1, 2, 4], dtype=torch.int32)"),
    "permute.tokens": (DOCS, "数据类型torch.bfloat16(当前版本permuted_tokens仅支持bfloat16)"),
    "permute.indices": (DOCS, "indices(torch.Tensor): 必选输入，2维Tensor，shape为（num_tokens，topK），"
                              "数据类型torch.int64"),
    "permute.max_indices": (DOCS, "indices 要求元素个数小于16777215"),
    "permute.max_topk": (DOCS, "topK小于等于512"),
    "permute.padded": (DOCS, "padded_mode当前仅支持False。"),
    "unpermute.sorted_indices": (DOCS, "表示需要计算的数据在permuted_tokens中的位置。数据类型支持int32，"
                                       "支持非连续Tensor，支持ND。取值范围是[0, tokens_num * topK_num - 1]，"
                                       "且没有重复索引。"),
    "unpermute.dtype": (DOCS, "shape为(num_tokens*topK，hidden_size），数据类型torch.bfloat16"),
    "unpermute.probs": (DOCS, "shape为（num_tokens，topK），支持的数据类型BFLOAT16"),
    "unpermute.max_topk": (DOCS, "topK_num要求小于等于512。"),
    "unpermute.padded": (DOCS, "目前仅支持padded_mode为False"),
    # npu_lightning_indexer / npu_sparse_flash_attention (+ _grad): DeepSeek Sparse Attention
    "dsa.dtype": (DOCS, "query（Tensor）：必选参数，不支持非连续，数据格式支持ND，数据类型支持bfloat16和float16。"),
    "dsa.value": (DOCS, "value（Tensor）：必选参数，不支持非连续，数据格式支持ND，数据类型支持bfloat16和float16。"),
    "li.weights": (DOCS, "weights（Tensor）：必选参数，不支持非连续，数据格式支持ND，数据类型支持bfloat16和float16，"
                         "支持输入shape[B,S1,N1]、[T,N1]。"),
    "li.sparse_count": (DOCS, "sparse_count（int）：可选参数，代表topK阶段需要保留的block数量，"
                              "支持1-2048以及3072、4096、5120、6144、7168、8192"),
    "li.sparse_mode": (DOCS, "sparse_mode（int）：可选参数，表示sparse的模式，支持0/3，数据类型支持int32。"),
    "li.right_down": (DOCS, "sparse_mode为3时，代表rightDownCausal模式的mask，对应以右顶点为划分的下三角场景。"),
    "li.layout": (DOCS, "layout_query（str）：可选参数，用于标识输入query的数据排布格式，"
                        "当前支持BSND、TND，默认值\"BSND\"。"),
    "sfa.indices": (DOCS, "当query的layout为BSND时，shape需要传入[B, Q_S, KV_N, sparse_size]"),
    "sfa.valid_first": (DOCS, "需要保证每行有效值均在前半部分，无效值均在后半部分。"),
    "sfa.right_down": (DOCS, "sparse_mode为3时，代表rightDownCausal模式的mask，"
                             "对应以右下顶点往左上为划分线的下三角场景。"),
    "sfa.softmax_stats": (META, "softmax_max = torch.empty([query.size(0), key.size(2), query.size(1), "
                                "query.size(2) // key.size(2)], dtype=torch.float32, device='meta')"),
    "kl.dtype": (DOCS, "query（Tensor）：必选参数，数据格式支持ND，数据类型支持BFLOAT16、FLOAT16。"
                       "支持输入shape(B, S1, N1, D)、(T1, N1, D)。"),
    "kl.weights": (DOCS, "weights（Tensor）：必选参数，数据格式支持ND，数据类型支持BFLOAT16、FLOAT16、FLOAT。"
                         "支持输入shape(B, S1, N1index)、(T1, N1index)。"),
    "kl.softmax": (DOCS, "softmax_max（Tensor）：必选参数，数据格式支持ND，数据类型支持FLOAT。"
                         "支持输入shape(B, N2, S1, G)、(N2, T1, G)。"),
    "kl.softmax_index": (DOCS, "softmax_max_index（Tensor）：必选参数，数据格式支持ND，数据类型支持FLOAT。"
                               "支持输入shape(B, N2index, S1)、(N2index, T1)。"),
}


def cite(key: str) -> str:
    """The source of documented rule `key`, as the tail of the error that enforces it."""
    relative, words = CITED[key]
    return f" [{relative}: {words}]"


# The compressed causal mask of sparse modes 2/3 is always this size, whatever the sequence length.
_COMPRESSED_MASK_SIZE = 2048
VARLEN_MAX_SEQUENCES = 1024  # entries of actual_seq_qlen in the varlen (TND) layout: CITED["fa.varlen_max"]
_LAYOUTS = ("BSH", "SBH", "BSND", "BNSD")


def _to_bnsd(x: torch.Tensor, layout: str, head_num: int | None, head_dim: int) -> torch.Tensor:
    """Bring one of q/k/v from the caller's layout to [B, N, S, D]; head_num None = infer from the hidden size."""
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.transpose(1, 2)
    if layout == "BSH":
        b, s, h = x.shape
        return x.view(b, s, h // head_dim, head_dim).transpose(1, 2)
    s, b, h = x.shape  # SBH
    return x.view(s, b, h // head_dim, head_dim).permute(1, 2, 0, 3)


def _from_bnsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.transpose(1, 2)
    b, n, s, d = x.shape
    if layout == "BSH":
        return x.transpose(1, 2).reshape(b, s, n * d)
    return x.permute(2, 0, 1, 3).reshape(s, b, n * d)  # SBH


def _expand_compressed_mask(mask: torch.Tensor, sq: int, skv: int, offset: int) -> torch.Tensor:
    """The full [Sq, Skv] mask that a compressed 2048x2048 causal mask stands for.

    The kernel reads the compressed mask along diagonals: element (i, j) takes the value the compressed mask has
    at the same distance j - i - offset from its main diagonal; distances beyond 2048 are fully masked (above) or
    fully visible (below). offset is 0 for the top-left causal mode and Skv - Sq for the bottom-right one.
    """
    n = _COMPRESSED_MASK_SIZE
    lowest = -(sq - 1) - offset
    dists = torch.arange(lowest, skv - offset)  # every distance j - i - offset that occurs
    clipped = dists.clamp(-(n - 1), n - 1)
    per_dist = torch.where(clipped >= 0, mask[0, clipped.clamp(min=0)], mask[(-clipped).clamp(min=0), 0])
    per_dist = (per_dist | (dists >= n)) & (dists > -n)
    index = torch.arange(skv).unsqueeze(0) - torch.arange(sq).unsqueeze(1) - offset - lowest
    return per_dist[index]


def _npu_fusion_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    scale: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = 2147483647,
    next_tockens: int = 2147483647,
    inner_precise: int = 0,
    prefix: list[int] | None = None,
    actual_seq_qlen: list[int] | None = None,
    actual_seq_kvlen: list[int] | None = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
    softmax_layout: str = "",
    sink: torch.Tensor | None = None,
    dropout_mask: torch.Tensor | None = None,
    seed: int = 0,
    offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """softmax(mask(scale * Q K^T)) V; returns (attention_out, softmax_max, softmax_sum, softmax_out, seed, offset,
    numels), attention_out in the input layout. TND: query [T, N1, D], key/value [T, N2, D] hold sequences one after
    the other, actual_seq_qlen / actual_seq_kvlen their cumulative ends; each attends within itself (the mask and
    sparse mode apply per sequence), at most VARLEN_MAX_SEQUENCES of them; softmax_max / softmax_sum are
    [T, N1, 8]."""
    calls["npu_fusion_attention"] += 1
    args = (pse, padding_mask, atten_mask, scale, keep_prob, pre_tockens, next_tockens, inner_precise, prefix)
    rest = (sparse_mode, gen_mask_parallel, sync, softmax_layout, sink, dropout_mask, seed, offset)
    if input_layout != "TND":
        return _fusion_attention_dense(query, key, value, head_num, input_layout, *args, actual_seq_qlen,
                                       actual_seq_kvlen, *rest)
    if actual_seq_qlen is None or actual_seq_kvlen is None:
        raise RuntimeError("npu_fusion_attention: layout TND needs actual_seq_qlen and actual_seq_kvlen"
                           + cite("fa.layout"))
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        raise RuntimeError("npu_fusion_attention: layout TND needs 3-D query/key/value" + cite("fa.layout"))
    if len(actual_seq_qlen) != len(actual_seq_kvlen):
        raise RuntimeError("npu_fusion_attention: actual_seq_qlen and actual_seq_kvlen differ in length"
                           + cite("fa.cumulative"))
    if len(actual_seq_qlen) > VARLEN_MAX_SEQUENCES:
        raise RuntimeError(f"npu_fusion_attention: {len(actual_seq_qlen)} sequences in actual_seq_qlen, at most "
                           f"{VARLEN_MAX_SEQUENCES} in the varlen layout" + cite("fa.varlen_max"))
    for ends, t in ((actual_seq_qlen, query.shape[0]), (actual_seq_kvlen, key.shape[0])):
        if not ends or ends[-1] != t or any(b <= a for a, b in zip([0, *ends], ends)):
            raise RuntimeError(f"npu_fusion_attention: cumulative lengths {list(ends)} must rise to T={t}"
                               + cite("fa.cumulative"))
    outs, maxes, sums = [], [], []
    for q0, q1, k0, k1 in zip([0, *actual_seq_qlen], actual_seq_qlen, [0, *actual_seq_kvlen], actual_seq_kvlen):
        out, row_max, row_sum, *_ = _fusion_attention_dense(
            query[None, q0:q1], key[None, k0:k1], value[None, k0:k1], head_num, "BSND", *args, None, None, *rest)
        outs.append(out[0])
        maxes.append(row_max[0].transpose(0, 1))
        sums.append(row_sum[0].transpose(0, 1))
    softmax_out = torch.empty(0, dtype=query.dtype, device=query.device)
    return torch.cat(outs), torch.cat(maxes), torch.cat(sums), softmax_out, 0, 0, 0


def _positions_masked(atten_mask: torch.Tensor | None, sparse_mode: int, sq: int, skv: int, pre_tockens: int,
                      next_tockens: int, device: torch.device) -> torch.Tensor | None:
    """The [.., Sq, Skv] bool mask (True = masked) that atten_mask and the sparse mode stand for, or None."""
    masked = None
    if sparse_mode in (2, 3):
        if atten_mask is None or tuple(atten_mask.shape) != (_COMPRESSED_MASK_SIZE,) * 2:
            raise RuntimeError(
                f"npu_fusion_attention: sparse_mode={sparse_mode} needs the compressed {_COMPRESSED_MASK_SIZE}x"
                f"{_COMPRESSED_MASK_SIZE} atten_mask" + cite("fa.compressed_mask")
            )
        if atten_mask.dtype not in (torch.bool, torch.uint8):
            raise RuntimeError("npu_fusion_attention: atten_mask must be bool or uint8" + cite("fa.mask"))
        offset = 0 if sparse_mode == 2 else skv - sq
        masked = _expand_compressed_mask(atten_mask.bool().cpu(), sq, skv, offset).to(device)
    elif sparse_mode in (0, 1):
        if atten_mask is not None:
            if atten_mask.dtype not in (torch.bool, torch.uint8):
                raise RuntimeError("npu_fusion_attention: atten_mask must be bool or uint8" + cite("fa.mask"))
            if tuple(atten_mask.shape[-2:]) != (sq, skv):
                raise RuntimeError(
                    f"npu_fusion_attention: sparse_mode={sparse_mode} needs an atten_mask of [..., {sq}, {skv}], "
                    f"got {list(atten_mask.shape)}" + cite("fa.mask_shape")
                )
            masked = atten_mask.bool()
            if sparse_mode == 0:
                # defaultMask: positions outside the band [i - pre_tockens, i + next_tockens] are masked too.
                dist = torch.arange(skv).unsqueeze(0) - torch.arange(sq).unsqueeze(1)
                band = (dist > next_tockens) | (-dist > pre_tockens)
                masked = masked | band.to(masked.device)
    else:
        raise NotImplementedError(f"fake npu_fusion_attention: sparse_mode={sparse_mode} is not modelled")

    return masked


def _npu_fusion_attention_grad(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dy: torch.Tensor,
    head_num: int,
    input_layout: str,
    pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    softmax_max: torch.Tensor | None = None,
    softmax_sum: torch.Tensor | None = None,
    softmax_in: torch.Tensor | None = None,
    attention_in: torch.Tensor | None = None,
    scale_value: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = 2147483647,
    next_tockens: int = 2147483647,
    inner_precise: int = 0,
    seed: int = 0,
    offset: int = 0,
    numels: int = 0,
    prefix: list[int] | None = None,
    actual_seq_qlen: list[int] | None = None,
    actual_seq_kvlen: list[int] | None = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
    softmax_layout: str = "",
    sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dpse, dsink) of npu_fusion_attention from the forward's softmax statistics: the probabilities
    are recomputed as exp(scale * Q K^T - softmax_max) / softmax_sum under the same mask, and attention_in (the
    forward's output) gives rowsum(dy * out). dk/dv come back with the key/value heads, in the input layout."""
    calls["npu_fusion_attention_grad"] += 1
    if input_layout not in _LAYOUTS:
        raise RuntimeError(f"npu_fusion_attention_grad: input_layout {input_layout!r} is not one of {_LAYOUTS}"
                           + cite("fa.layout"))
    if softmax_max is None or softmax_sum is None or attention_in is None:
        raise RuntimeError("npu_fusion_attention_grad: needs softmax_max, softmax_sum and attention_in"
                           + cite("fa.softmax_stats"))
    if (pse is not None or padding_mask is not None or prefix is not None or actual_seq_qlen is not None
            or sink is not None or softmax_layout or keep_prob != 1.0):
        raise NotImplementedError("fake npu_fusion_attention_grad: pse / padding_mask / prefix / varlen / sink / "
                                  "softmax_layout / dropout are not modelled")
    head_dim = query.shape[-1] if input_layout in ("BSND", "BNSD") else query.shape[-1] // head_num
    q, k, v, do, out = (_to_bnsd(t, input_layout, head_num if t is not key and t is not value else None,
                                 head_dim).float() for t in (query, key, value, dy, attention_in))
    b, n1, sq, _ = q.shape
    n2, skv = k.shape[1], k.shape[2]
    if tuple(softmax_max.shape) != (b, n1, sq, 8) or softmax_sum.shape != softmax_max.shape:
        raise RuntimeError(f"npu_fusion_attention_grad: softmax_max/sum must be [{b}, {n1}, {sq}, 8]"
                           + cite("fa.softmax_stats"))
    group = n1 // n2
    scores = torch.matmul(q, k.repeat_interleave(group, dim=1).transpose(-2, -1)) * scale_value
    masked = _positions_masked(atten_mask, sparse_mode, sq, skv, pre_tockens, next_tockens, scores.device)
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    probs = torch.exp(scores - softmax_max[..., :1].float()) / softmax_sum[..., :1].float()
    dv = torch.matmul(probs.transpose(-2, -1), do)
    dscores = probs * (torch.matmul(do, v.repeat_interleave(group, dim=1).transpose(-2, -1))
                       - (do * out).sum(-1, keepdim=True)) * scale_value
    dq = torch.matmul(dscores, k.repeat_interleave(group, dim=1))
    dk = torch.matmul(dscores.transpose(-2, -1), q)
    dk, dv = (t.unflatten(1, (n2, group)).sum(2) for t in (dk, dv))
    grads = tuple(_from_bnsd(t, input_layout).to(query.dtype) for t in (dq, dk, dv))
    empty = torch.empty(0, dtype=query.dtype, device=query.device)
    return (*grads, empty, torch.empty(0, device=query.device))


def _fusion_attention_dense(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    scale: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = 2147483647,
    next_tockens: int = 2147483647,
    inner_precise: int = 0,
    prefix: list[int] | None = None,
    actual_seq_qlen: list[int] | None = None,
    actual_seq_kvlen: list[int] | None = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
    softmax_layout: str = "",
    sink: torch.Tensor | None = None,
    dropout_mask: torch.Tensor | None = None,
    seed: int = 0,
    offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """npu_fusion_attention in the layouts with whole sequences (BSH, SBH, BSND, BNSD)."""
    if input_layout not in _LAYOUTS:
        raise RuntimeError(f"npu_fusion_attention: input_layout {input_layout!r} is not one of {_LAYOUTS}"
                           + cite("fa.layout"))
    if not (query.dtype == key.dtype == value.dtype) or query.dtype not in (torch.float16, torch.bfloat16,
                                                                            torch.float32):
        raise RuntimeError("npu_fusion_attention: query, key and value must share one of fp16, bf16, fp32"
                           + cite("fa.dtype"))
    if (pse is not None or padding_mask is not None or prefix is not None or actual_seq_qlen is not None
            or sink is not None or dropout_mask is not None or softmax_layout):
        raise NotImplementedError("fake npu_fusion_attention: pse / padding_mask / prefix / varlen / sink / "
                                  "dropout_mask / softmax_layout are not modelled")
    if keep_prob != 1.0:
        raise NotImplementedError("fake npu_fusion_attention: dropout (keep_prob < 1) is not modelled")
    expected_dims = 3 if input_layout in ("BSH", "SBH") else 4
    if query.dim() != expected_dims or key.dim() != expected_dims or value.dim() != expected_dims:
        raise RuntimeError(f"npu_fusion_attention: layout {input_layout} needs {expected_dims}-D query/key/value"
                           + cite("fa.layout"))
    if input_layout in ("BSH", "SBH"):
        if query.shape[-1] % head_num:
            raise RuntimeError("npu_fusion_attention: hidden size is not a multiple of head_num" + cite("fa.head_num"))
        head_dim = query.shape[-1] // head_num
    else:
        head_dim = query.shape[-1]
        n_axis = 2 if input_layout == "BSND" else 1
        if query.shape[n_axis] != head_num:
            raise RuntimeError(
                f"npu_fusion_attention: head_num={head_num} but query has {query.shape[n_axis]} heads in "
                f"layout {input_layout}" + cite("fa.head_num")
            )
    q = _to_bnsd(query, input_layout, head_num, head_dim).float()
    k = _to_bnsd(key, input_layout, None, head_dim).float()
    v = _to_bnsd(value, input_layout, None, head_dim).float()
    b, n1, sq, _ = q.shape
    n2, skv = k.shape[1], k.shape[2]
    if k.shape[0] != b or v.shape != k.shape or k.shape[-1] != head_dim:
        raise RuntimeError("npu_fusion_attention: key/value shapes do not fit the query" + cite("fa.key_value"))
    if n1 % n2:
        raise RuntimeError(f"npu_fusion_attention: query heads {n1} not a multiple of key/value heads {n2}"
                           + cite("fa.gqa"))
    # GQA: query heads [g*G, (g+1)*G) share key/value head g.
    k = k.repeat_interleave(n1 // n2, dim=1)
    v = v.repeat_interleave(n1 // n2, dim=1)
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # [B, N1, Sq, Skv]

    masked = _positions_masked(atten_mask, sparse_mode, sq, skv, pre_tockens, next_tockens, scores.device)
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v).to(query.dtype)
    with torch.no_grad():  # the softmax statistics the kernel returns for its backward: row max and sum of exp
        row_max = scores.amax(dim=-1, keepdim=True)
        row_sum = torch.exp(torch.logsumexp(scores, dim=-1, keepdim=True) - row_max)
    softmax_max = row_max.expand(b, n1, sq, 8).contiguous()
    softmax_sum = row_sum.expand(b, n1, sq, 8).contiguous()
    softmax_out = torch.empty(0, dtype=query.dtype, device=query.device)
    return _from_bnsd(out, input_layout), softmax_max, softmax_sum, softmax_out, 0, 0, 0


def _npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd): y = x * rsqrt(mean(x^2) + eps) * gamma over gamma's trailing dims, y in x's dtype, rstd in fp32;
    gamma in x's dtype."""
    calls["npu_rms_norm"] += 1
    if self.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise RuntimeError("npu_rms_norm: input must be fp16, bf16 or fp32" + cite("rms.dtype"))
    if gamma.dtype != self.dtype:
        raise RuntimeError(f"npu_rms_norm: gamma dtype {gamma.dtype} must be the input's ({self.dtype})"
                           + cite("rms.gamma"))
    g = gamma.dim()
    if tuple(self.shape[-g:]) != tuple(gamma.shape):
        raise RuntimeError(f"npu_rms_norm: gamma shape {list(gamma.shape)} is not the input's trailing dims"
                           + cite("rms.gamma"))
    dims = tuple(range(self.dim() - g, self.dim()))
    x32 = self.float()
    rstd = torch.rsqrt(x32.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    return (x32 * rstd * gamma.float()).to(self.dtype), rstd


def _rotate(x: torch.Tensor, rotary_mode: str) -> torch.Tensor:
    if rotary_mode == "half":
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


# npu_rotary_mul's documented limits (jit_compile=False): D even and below 896; B * N below 1000 in interleave mode,
# B and N each below 1000 in half mode (CITED["rope.half"], ["rope.interleave"]); in interleave mode r1/r2 broadcast
# over batch and heads (1S1D for BSND: CITED["rope.interleave_tables"]).
ROTARY_MAX_HEAD_DIM = 896
ROTARY_MAX_BN = 1000


def _npu_rotary_mul(input: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half",
                    rotate: torch.Tensor | None = None) -> torch.Tensor:
    """output = r1 * input + r2 * rotate(input), rotate by halves ("half") or by adjacent pairs ("interleave")."""
    calls["npu_rotary_mul"] += 1
    if rotate is not None:
        raise NotImplementedError("fake npu_rotary_mul: the rotate matrix is not modelled")
    if rotary_mode not in ("half", "interleave"):
        raise RuntimeError(f"npu_rotary_mul: rotary_mode {rotary_mode!r} is not 'half' or 'interleave'"
                           + cite("rope.mode"))
    if input.dim() != 4 or r1.dim() != 4 or r2.dim() != 4:
        raise RuntimeError("npu_rotary_mul: input, r1 and r2 must be 4-D" + cite("rope.dims"))
    if r1.shape != r2.shape or r1.dtype != input.dtype or r2.dtype != input.dtype:
        raise RuntimeError("npu_rotary_mul: r1 and r2 must have one shape and the input's dtype"
                           + cite("rope.table_dtype"))
    d = input.shape[-1]
    if r1.shape[-1] != d or d % 2 or d >= ROTARY_MAX_HEAD_DIM:
        raise RuntimeError(f"npu_rotary_mul: head size {d} must be even, below {ROTARY_MAX_HEAD_DIM}, and r1/r2's"
                           + cite("rope.interleave" if rotary_mode == "interleave" else "rope.half"))
    b, n = input.shape[0], input.shape[2]
    if rotary_mode == "interleave":
        if b * n >= ROTARY_MAX_BN:
            raise RuntimeError(f"npu_rotary_mul: interleave mode needs B * N < {ROTARY_MAX_BN}, got {b} * {n}"
                               + cite("rope.interleave"))
        if r1.shape[0] != 1 or r1.shape[2] != 1:
            raise RuntimeError(f"npu_rotary_mul: interleave mode needs r1/r2 of 1S1D, got {list(r1.shape)}"
                               + cite("rope.interleave_tables"))
    elif b >= ROTARY_MAX_BN or n >= ROTARY_MAX_BN:
        raise RuntimeError(f"npu_rotary_mul: half mode needs B and N below {ROTARY_MAX_BN}, got {b} and {n}"
                           + cite("rope.half"))
    try:
        torch.broadcast_shapes(r1.shape, input.shape)
    except RuntimeError as e:
        raise RuntimeError(f"npu_rotary_mul: r1 shape {list(r1.shape)} does not broadcast to the input"
                           + cite("rope.half_tables")) from e
    x32 = input.float()
    return (r1.float() * x32 + r2.float() * _rotate(x32, rotary_mode)).to(input.dtype)


def _npu_swiglu(self: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """swish(A) * B where A, B are the first and second halves of the input along dim."""
    calls["npu_swiglu"] += 1
    if self.shape[dim] % 2:
        raise RuntimeError(f"npu_swiglu: size {self.shape[dim]} of dim {dim} is not even" + cite("swiglu.halves"))
    a, b = torch.chunk(self.float(), 2, dim=dim)
    return (F.silu(a) * b).to(self.dtype)


# --- mixture-of-experts kernels -----------------------------------------------------------------------------------
# From the wheel's API reference (torch_npu/_op_plugin_docs.py, CITED above) and meta registrations. Of these,
# torch_npu 2.13.0 registers a backward (generated autograd nodes NpuMoeTokenPermuteBackward0 /
# NpuMoeTokenUnpermuteBackward0 in torch_npu/lib/libtorch_npu.so) for the token permutation ops only:
# npu_grouped_matmul, npu_grouped_matmul_add_ and npu_moe_gating_top_k_softmax have none (WITHOUT_AUTOGRAD below).

GMM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # CITED["gmm.dtype"]
GMM_ADD_DTYPES = (torch.float16, torch.bfloat16)  # CITED["gmma.dtype"]
GMM_INNER_LIMIT = 65536  # CITED["gmm.inner_limit"], ["gmma.inner_limit"]
GMM_MAX_GROUPS = 1024  # CITED["gmm.max_groups"], ["gmma.max_groups"]
PERMUTE_MAX_TOPK = 512  # CITED["permute.max_topk"], ["unpermute.max_topk"]
PERMUTE_MAX_INDICES = 16777215  # indices hold fewer elements than this: CITED["permute.max_indices"]
GATING_MAX_K = 1024  # CITED["gating.k"]


def _inner_size(t: torch.Tensor) -> int:
    """The length of t's stored last axis: its last dim, or the one before when t is a transposed view."""
    return t.shape[-2] if _transposed(t) else t.shape[-1]


def _transposed(t: torch.Tensor) -> bool:
    """Whether t is a transposed view (its last two axes swapped in memory)."""
    return t.dim() >= 2 and t.stride(-1) != 1 and t.stride(-2) == 1


def _group_sizes(group_list: torch.Tensor, group_list_type: int, op: str, monotone: str) -> torch.Tensor:
    """The groups' sizes from group_list (int64, 1-D): cumulative ends (type 0) or sizes (1), none negative."""
    if group_list.dtype != torch.int64 or group_list.dim() != 1:
        raise RuntimeError(f"{op}: group_list must be a 1-D int64 tensor, got {group_list.dtype} of "
                           f"{group_list.dim()} dims" + cite("gmm.group_list"))
    if group_list_type not in (0, 1):
        raise RuntimeError(f"{op}: group_list_type {group_list_type} is not 0 (cumsum) or 1 (counts)"
                           + cite("gmm.group_list_type"))
    sizes = group_list if group_list_type == 1 else torch.diff(group_list, prepend=group_list.new_zeros(1))
    if bool((sizes < 0).any()):
        raise RuntimeError(f"{op}: group_list must be non-negative and, as cumsum, non-decreasing" + cite(monotone))
    return sizes


def _npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                        antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
                        activation_quant_scale=None, activation_quant_offset=None, split_item=0, group_type=None,
                        group_list_type=0, act_type=0, tuning_config=None, output_dtype=None, x_dtype=None,
                        weight_dtype=None, scale_dtype=None, per_token_scale_dtype=None) -> list[torch.Tensor]:
    """The non-quantised single-tensor case: one x, one weight, a group_list tensor, one output (split_item 2/3).

    group_type 0 splits x [M, K]'s rows: y[rows of g] = x[rows of g] @ weight[g], weight [E, K, N] (a transposed view
    allowed, x not) -> y [M, N]; at most 1024 groups. On Atlas A2 the only other group_type is -1 (no groups).
    group_list: int64, cumulative ends (group_list_type 0) or sizes (1), one per group, covering every row of x.
    """
    calls["npu_grouped_matmul"] += 1
    quantised = (bias, scale, offset, antiquant_scale, antiquant_offset, per_token_scale, activation_input,
                 activation_quant_scale, activation_quant_offset, tuning_config, output_dtype, x_dtype,
                 weight_dtype, scale_dtype, per_token_scale_dtype)
    if any(a is not None for a in quantised) or act_type:
        raise NotImplementedError("fake npu_grouped_matmul: bias, quantisation, activation and tuning are not modelled")
    if group_type not in (-1, 0):
        raise RuntimeError(f"npu_grouped_matmul: group_type {group_type} is not supported on Atlas A2 (-1 or 0)"
                           + cite("gmm.group_type"))
    if len(x) != 1 or len(weight) != 1 or split_item not in (2, 3) or group_list is None or group_type != 0:
        raise NotImplementedError("fake npu_grouped_matmul: only one x, one weight, a group_list tensor, group_type 0 "
                                  "and one output (split_item 2 or 3) are modelled")
    (a,), (b,) = x, weight
    if a.dtype not in GMM_DTYPES or b.dtype != a.dtype:
        raise RuntimeError(f"npu_grouped_matmul: x {a.dtype} and weight {b.dtype} must share one of fp16, bf16, fp32"
                           + cite("gmm.dtype"))
    sizes = _group_sizes(group_list, group_list_type, "npu_grouped_matmul", "gmm.monotone")
    if group_list.shape[0] > GMM_MAX_GROUPS:
        raise RuntimeError(f"npu_grouped_matmul: {group_list.shape[0]} groups, at most {GMM_MAX_GROUPS} per call"
                           + cite("gmm.max_groups"))
    if a.dim() != 2 or b.dim() != 3 or b.shape[0] != group_list.shape[0] or b.shape[1] != a.shape[1]:
        raise RuntimeError(f"npu_grouped_matmul: group_type 0 needs x [M, K] and weight [E, K, N] with E = "
                           f"len(group_list) = {group_list.shape[0]}, got {list(a.shape)} and {list(b.shape)}"
                           + cite("gmm.single"))
    if _transposed(a):
        raise RuntimeError("npu_grouped_matmul: x must not be a transposed view" + cite("gmm.max_groups"))
    for name, t in (("x", a), ("weight", b)):
        if _inner_size(t) >= GMM_INNER_LIMIT:
            raise RuntimeError(f"npu_grouped_matmul: the inner axis of {name} ({_inner_size(t)}) must be below "
                               f"{GMM_INNER_LIMIT}" + cite("gmm.inner_limit"))
    if int(sizes.sum()) != a.shape[0]:
        raise RuntimeError(f"npu_grouped_matmul: the groups cover {int(sizes.sum())} rows, x has {a.shape[0]}"
                           + cite("gmm.single"))
    parts = torch.split(a.float(), sizes.tolist())
    return [torch.cat([p @ b[g].float() for g, p in enumerate(parts)]).to(a.dtype)]


def _npu_grouped_matmul_add_(self: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, group_list: torch.Tensor, *,
                             transpose_x: bool = True, transpose_weight: bool = False, group_type: int = 2,
                             group_list_type: int = 0) -> torch.Tensor:
    """self[g] += x[rows of g]^T @ weight[rows of g] in place (groups split x's first axis, the contracted K): self
    [g, M, N] fp32, x [K, M] and weight [K, N] fp16/bf16, at most 1024 groups; rows past the last group are not read
    and an empty group adds nothing."""
    calls["npu_grouped_matmul_add_"] += 1
    if group_type != 2:
        raise RuntimeError(f"npu_grouped_matmul_add_: group_type {group_type} is not 2" + cite("gmma.group_type"))
    if not transpose_x or transpose_weight:
        raise RuntimeError("npu_grouped_matmul_add_: x is read transposed and weight as it is (transpose_x=True, "
                           "transpose_weight=False)" + cite("gmma.transpose"))
    if x.dtype not in GMM_ADD_DTYPES or weight.dtype != x.dtype or self.dtype != torch.float32:
        raise RuntimeError(f"npu_grouped_matmul_add_: x {x.dtype} and weight {weight.dtype} must share fp16 or bf16, "
                           f"self {self.dtype} must be fp32" + cite("gmma.dtype"))
    sizes = _group_sizes(group_list, group_list_type, "npu_grouped_matmul_add_", "gmma.group_list")
    if group_list.shape[0] > GMM_MAX_GROUPS:
        raise RuntimeError(f"npu_grouped_matmul_add_: {group_list.shape[0]} groups, at most {GMM_MAX_GROUPS} per call"
                           + cite("gmma.max_groups"))
    if (x.dim() != 2 or weight.dim() != 2 or self.dim() != 3 or x.shape[0] != weight.shape[0]
            or tuple(self.shape) != (group_list.shape[0], x.shape[1], weight.shape[1])):
        raise RuntimeError(f"npu_grouped_matmul_add_: needs x [K, M], weight [K, N] and self [len(group_list), M, N], "
                           f"got {list(x.shape)}, {list(weight.shape)}, {list(self.shape)}" + cite("gmma.self"))
    for name, t in (("x", x), ("weight", weight)):
        if t.shape[-1] >= GMM_INNER_LIMIT:
            raise RuntimeError(f"npu_grouped_matmul_add_: the last dim of {name} ({t.shape[-1]}) must be below "
                               f"{GMM_INNER_LIMIT}" + cite("gmma.inner_limit"))
    covered = int(sizes.sum())
    if covered > x.shape[0]:
        raise RuntimeError(f"npu_grouped_matmul_add_: the groups cover {covered} rows, x has {x.shape[0]}"
                           + cite("gmma.group_list"))
    x_parts = torch.split(x[:covered].float(), sizes.tolist())
    w_parts = torch.split(weight[:covered].float(), sizes.tolist())
    return self.add_(torch.stack([p.T @ q for p, q in zip(x_parts, w_parts)]))


def _npu_moe_gating_top_k_softmax(x: torch.Tensor, finished: torch.Tensor | None = None, k: int = 1
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, expert_idx, row_idx): y the k largest softmax values of each row (descending, not renormalised, in x's
    dtype), expert_idx their int32 columns, row_idx[i, j] = j * rows + i (the layout npu_moe_init_routing reads; the
    API reference does not spell it out and the project does not read it)."""
    calls["npu_moe_gating_top_k_softmax"] += 1
    if finished is not None:
        raise NotImplementedError("fake npu_moe_gating_top_k_softmax: finished is not modelled")
    if x.dtype not in GMM_DTYPES or x.dim() not in (2, 3):
        raise RuntimeError(f"npu_moe_gating_top_k_softmax: x must be 2-D or 3-D fp16/bf16/fp32, got {x.dim()}-D "
                           f"{x.dtype}" + cite("gating.x"))
    if not 0 < k <= min(x.shape[-1], GATING_MAX_K):
        raise RuntimeError(f"npu_moe_gating_top_k_softmax: k={k} must be in (0, min(experts, {GATING_MAX_K})]"
                           + cite("gating.k"))
    values, idx = torch.topk(torch.softmax(x.float(), dim=-1), k, dim=-1)
    rows = x.numel() // x.shape[-1]
    row_idx = (torch.arange(k, device=x.device) * rows + torch.arange(rows, device=x.device).unsqueeze(1))
    row_idx = row_idx.view(*x.shape[:-1], k)
    return values.to(x.dtype), idx.to(torch.int32), row_idx.to(torch.int32)


def _npu_moe_token_permute(tokens: torch.Tensor, indices: torch.Tensor, num_out_tokens: int | None = None,
                           padded_mode: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(permuted_tokens, sorted_indices): the token copies sorted stably by expert, cut to num_out_tokens rows;
    sorted_indices int32 with permuted_tokens[sorted_indices[i]] = tokens[i // topK] (where copy i of the flattened
    [T, topK] indices went: the inverse of the stable sort). bf16 tokens, int64 indices [T, topK]."""
    calls["npu_moe_token_permute"] += 1
    if padded_mode:
        raise RuntimeError("npu_moe_token_permute: padded_mode=True is not supported" + cite("permute.padded"))
    if tokens.dtype != torch.bfloat16 or tokens.dim() != 2:
        raise RuntimeError(f"npu_moe_token_permute: tokens must be 2-D bf16, got {tokens.dim()}-D {tokens.dtype}"
                           + cite("permute.tokens"))
    if indices.dtype != torch.int64 or indices.dim() != 2 or indices.shape[0] != tokens.shape[0]:
        raise RuntimeError(f"npu_moe_token_permute: indices must be [tokens, topK] int64, got {indices.dim()}-D "
                           f"{indices.dtype}" + cite("permute.indices"))
    topk = indices.shape[1]
    if topk > PERMUTE_MAX_TOPK:
        raise RuntimeError(f"npu_moe_token_permute: topK={topk} must be at most {PERMUTE_MAX_TOPK}"
                           + cite("permute.max_topk"))
    if indices.numel() >= PERMUTE_MAX_INDICES:
        raise RuntimeError(f"npu_moe_token_permute: indices hold {indices.numel()} elements, fewer than "
                           f"{PERMUTE_MAX_INDICES} are allowed" + cite("permute.max_indices"))
    order = torch.argsort(indices.reshape(-1), stable=True)
    sorted_indices = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    n = indices.numel()
    keep = n if not num_out_tokens else (min(num_out_tokens, n) if num_out_tokens > 0 else n + num_out_tokens)
    return tokens.index_select(0, order[:keep] // topk), sorted_indices.to(torch.int32)


def _npu_moe_token_unpermute(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor,
                             probs: torch.Tensor | None = None, padded_mode: bool = False,
                             restore_shape: list[int] | None = None) -> torch.Tensor:
    """out[t] = sum_j probs[t, j] * permuted_tokens[sorted_indices[t * topK + j]] (topK = probs' second dim, or 1):
    sorted_indices is where each token copy sits in permuted_tokens, npu_moe_token_permute's second output. bf16 in
    and out, the sum in fp32."""
    calls["npu_moe_token_unpermute"] += 1
    if padded_mode:
        raise RuntimeError("npu_moe_token_unpermute: padded_mode=True is not supported" + cite("unpermute.padded"))
    if permuted_tokens.dtype != torch.bfloat16 or permuted_tokens.dim() != 2:
        raise RuntimeError(f"npu_moe_token_unpermute: permuted_tokens must be 2-D bf16, got {permuted_tokens.dtype}"
                           + cite("unpermute.dtype"))
    if probs is not None and (probs.dtype != torch.bfloat16 or probs.dim() != 2):
        raise RuntimeError(f"npu_moe_token_unpermute: probs must be [tokens, topK] bf16, got {probs.dtype}"
                           + cite("unpermute.probs"))
    topk = 1 if probs is None else probs.shape[1]
    if topk > PERMUTE_MAX_TOPK:
        raise RuntimeError(f"npu_moe_token_unpermute: topK={topk} must be at most {PERMUTE_MAX_TOPK}"
                           + cite("unpermute.max_topk"))
    n = permuted_tokens.shape[0]
    if (sorted_indices.dtype != torch.int32 or sorted_indices.dim() != 1 or sorted_indices.shape[0] != n
            or not torch.equal(sorted_indices.sort().values, torch.arange(n, dtype=torch.int32))):
        raise RuntimeError("npu_moe_token_unpermute: sorted_indices must be int32, one per permuted token, each of "
                           f"0..{n - 1} once" + cite("unpermute.sorted_indices"))
    rows = permuted_tokens.float().index_select(0, sorted_indices.long()).view(-1, topk, permuted_tokens.shape[1])
    if probs is not None:
        rows = rows * probs.float().unsqueeze(-1)
    return rows.sum(dim=1).to(permuted_tokens.dtype)


# --- DeepSeek Sparse Attention kernels ------------------------------------------------------------------------------
# From the wheel's API reference and meta registrations (CITED above) and, where the reference leaves the maths
# open, the vendor's golden code: the indexer's score sum over a key head's query heads of w_h ReLU(q_h . k), no
# scale of its own (Huawei's LightningIndexer README, sgl-project/sgl-kernel-npu csrc/lightning_indexer/README.md);
# op-plugin's test/test_custom_ops/test_npu_lightning_indexer.py (_lightning_indexer) ranks the same way; the
# attention reads each row's indices up to the first -1, query head h attends with key head h // G, and
# sparse_mode 3 masks selected keys at or past S2 - S1 + i + 1 (Ascend/op-plugin
# test/test_custom_ops/test_npu_sparse_flash_attention.py: cpu_sparse_flash_attention, gather_kv, mask). Only the
# BSND layout with whole sequences, one key per index and attention_mode 0 (a value of its own) are modelled.

DSA_DTYPES = (torch.float16, torch.bfloat16)  # CITED["dsa.dtype"], ["dsa.value"], ["li.weights"]
INDEXER_SPARSE_COUNTS = frozenset((*range(1, 2049), 3072, 4096, 5120, 6144, 7168, 8192))  # CITED["li.sparse_count"]


def _dsa_operand(op: str, name: str, t: torch.Tensor, key: str) -> None:
    """fp16/bf16 and contiguous, as both kernels require of every tensor operand."""
    if t.dtype not in DSA_DTYPES:
        raise RuntimeError(f"{op}: {name} must be fp16 or bf16, got {t.dtype}" + cite(key))
    if not t.is_contiguous():
        raise RuntimeError(f"{op}: {name} must be contiguous" + cite(key))


def _right_down_visible(s1: int, s2: int, device: torch.device) -> torch.Tensor:
    """bool [S1, S2]: rightDownCausal, query i sees keys 0 .. S2 - S1 + i."""
    return torch.arange(s2, device=device)[None, :] <= (s2 - s1 + torch.arange(s1, device=device))[:, None]


def _npu_lightning_indexer(query: torch.Tensor, key: torch.Tensor, weights: torch.Tensor, *,
                           actual_seq_lengths_query: torch.Tensor | None = None,
                           actual_seq_lengths_key: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                           layout_query: str = "BSND", layout_key: str = "BSND", sparse_count: int = 2048,
                           sparse_mode: int = 3, pre_tokens: int = 9223372036854775807,
                           next_tokens: int = 9223372036854775807, return_value: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sparse_indices [B, S1, N2, sparse_count] int32, sparse_values): for each query and key head, the keys by
    the sum over the head's N1 / N2 query heads of weights * ReLU(q . k), best first, those sparse_mode hides
    (3: rightDownCausal; 0: none) after every visible one; -1 past the S2 keys there are."""
    calls["npu_lightning_indexer"] += 1
    op = "npu_lightning_indexer"
    if layout_query not in ("BSND", "TND") or layout_key not in ("BSND", "TND", "PA_BSND"):
        raise RuntimeError(f"{op}: layouts {layout_query!r} / {layout_key!r} are not supported" + cite("li.layout"))
    if (layout_query != "BSND" or layout_key != "BSND" or block_table is not None or return_value
            or actual_seq_lengths_query is not None or actual_seq_lengths_key is not None):
        raise NotImplementedError(f"fake {op}: TND, PageAttention, actual lengths and return_value are not modelled")
    for name, t, key_ in (("query", query, "dsa.dtype"), ("key", key, "dsa.dtype"), ("weights", weights, "li.weights")):
        _dsa_operand(op, name, t, key_)
    if sparse_count not in INDEXER_SPARSE_COUNTS:
        raise RuntimeError(f"{op}: sparse_count={sparse_count} is not offered" + cite("li.sparse_count"))
    if sparse_mode not in (0, 3):
        raise RuntimeError(f"{op}: sparse_mode={sparse_mode} is not 0 or 3" + cite("li.sparse_mode"))
    b, s1, n1, d = query.shape
    s2, n2 = key.shape[1], key.shape[2]
    if tuple(weights.shape) != (b, s1, n1):
        raise RuntimeError(f"{op}: weights must be [B, S1, N1] = {[b, s1, n1]}, got {list(weights.shape)}"
                           + cite("li.weights"))
    if n1 % n2 or key.shape[0] != b or key.shape[3] != d:
        raise NotImplementedError(f"fake {op}: query {list(query.shape)} and key {list(key.shape)} do not group")
    q = query.float().view(b, s1, n2, n1 // n2, d)
    relu = torch.einsum("bsngd,btnd->bsngt", q, key.float()).relu()
    scores = (relu * weights.float().view(b, s1, n2, n1 // n2, 1)).sum(3)  # [B, S1, N2, S2]
    if sparse_mode == 3:
        visible = _right_down_visible(s1, s2, query.device)
        scores = scores.masked_fill(~visible[None, :, None, :], float("-inf"))
    # The golden's rows: the scores sorted with the masked ones last, min(sparse_count, S2) kept, -1 past S2 (the
    # stricter of the vendor's two readings for a row that sees fewer keys: the KL-loss example fills -1 instead).
    indices = scores.topk(min(sparse_count, s2), dim=-1).indices
    indices = F.pad(indices, (0, sparse_count - indices.shape[-1]), value=-1)
    return indices.to(torch.int32), torch.empty(0, dtype=query.dtype, device=query.device)


def _sfa_scores(op: str, query, key, value, sparse_indices, scale_value, query_rope, key_rope, layout, sparse_mode,
                attention_mode, sparse_block_size):
    """The checks both sparse attention kernels make, and (q, selected keys, selected values, scores) in fp32:
    q [B, S1, N2, G, D + Dr], keys [B, S1, N2, K, D + Dr], values [B, S1, N2, K, Dv], the scaled scores
    [B, S1, N2, G, K] with -inf where no key is read; the int64 indices [B, S1, N2, K] (0 where -1)."""
    if layout != "BSND" or sparse_block_size != 1 or attention_mode != 0 or value is None:
        raise NotImplementedError(f"fake {op}: only BSND, sparse_block_size 1 and attention_mode 0 with a value "
                                  f"are modelled")
    for name, t in (("query", query), ("key", key), ("query_rope", query_rope), ("key_rope", key_rope)):
        if t is not None:
            _dsa_operand(op, name, t, "dsa.dtype")
    _dsa_operand(op, "value", value, "dsa.value")
    if not query.dtype == key.dtype == value.dtype:
        raise RuntimeError(f"{op}: query, key and value must share one dtype" + cite("dsa.value"))
    b, s1, n1, _ = query.shape
    s2, n2 = key.shape[1], key.shape[2]
    if (sparse_indices.dtype != torch.int32 or sparse_indices.dim() != 4
            or tuple(sparse_indices.shape[:3]) != (b, s1, n2)):
        raise RuntimeError(f"{op}: sparse_indices must be int32 [B, Q_S, KV_N, sparse_size] with [B, Q_S, KV_N] = "
                           f"{[b, s1, n2]}, got {sparse_indices.dtype} {list(sparse_indices.shape)}"
                           + cite("sfa.indices"))
    read = sparse_indices >= 0
    if bool((read[..., 1:] & ~read[..., :-1]).any()):
        raise RuntimeError(f"{op}: a row of sparse_indices holds an index after a -1" + cite("sfa.valid_first"))
    if sparse_mode not in (0, 3):
        raise RuntimeError(f"{op}: sparse_mode={sparse_mode} is not 0 or 3" + cite("sfa.right_down"))
    if n1 % n2:
        raise NotImplementedError(f"fake {op}: {n1} query heads do not group over {n2} key heads")
    if sparse_mode == 3:  # keys at or past S2 - S1 + i + 1 are masked even when selected
        limit = (s2 - s1 + torch.arange(s1, device=query.device)).view(1, s1, 1, 1)
        read = read & (sparse_indices <= limit)
    q = query if query_rope is None else torch.cat([query, query_rope], dim=-1)
    k = key if key_rope is None else torch.cat([key, key_rope], dim=-1)
    index = sparse_indices.clamp(min=0).long()
    batch = torch.arange(b, device=query.device).view(b, 1, 1, 1)
    head = torch.arange(n2, device=query.device).view(1, 1, n2, 1)
    q = q.float().view(b, s1, n2, n1 // n2, q.shape[-1])
    k_sel, v_sel = k.float()[batch, index, head], value.float()[batch, index, head]
    scores = torch.einsum("bsngd,bsnkd->bsngk", q, k_sel) * scale_value
    return q, k_sel, v_sel, scores.masked_fill(~read.unsqueeze(3), float("-inf")), index


def _npu_sparse_flash_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None,
                                sparse_indices: torch.Tensor, scale_value: float, *,
                                block_table: torch.Tensor | None = None,
                                actual_seq_lengths_query: torch.Tensor | None = None,
                                actual_seq_lengths_kv: torch.Tensor | None = None,
                                query_rope: torch.Tensor | None = None, key_rope: torch.Tensor | None = None,
                                sparse_block_size: int = 1, layout_query: str = "BSND", layout_kv: str = "BSND",
                                sparse_mode: int = 3, pre_tokens: int = 9223372036854775807,
                                next_tokens: int = 9223372036854775807, attention_mode: int = 0,
                                return_softmax_lse: bool = False, sinks: torch.Tensor | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(attention_out [B, S1, N1, D], softmax_max, softmax_sum): each query attends to the keys its key head's row
    of sparse_indices selects, softmax(scale * [q, q_rope] . [k, k_rope]) v; the statistics [B, N2, S1, G] fp32 (the
    scores' row max and the sum of exp(score - max)) with return_softmax_lse, else empty."""
    calls["npu_sparse_flash_attention"] += 1
    op = "npu_sparse_flash_attention"
    if (layout_query != layout_kv or block_table is not None or actual_seq_lengths_query is not None
            or actual_seq_lengths_kv is not None or sinks is not None):
        raise NotImplementedError(f"fake {op}: PageAttention, actual lengths and sinks are not modelled")
    _, _, v_sel, scores, _ = _sfa_scores(op, query, key, value, sparse_indices, scale_value, query_rope, key_rope,
                                         layout_query, sparse_mode, attention_mode, sparse_block_size)
    row_max = scores.amax(dim=-1)
    row_sum = torch.exp(scores - row_max.unsqueeze(-1)).sum(dim=-1)
    out = torch.einsum("bsngk,bsnkd->bsngd", torch.softmax(scores, dim=-1), v_sel)
    out = out.reshape(*query.shape[:3], out.shape[-1]).to(query.dtype)
    if not return_softmax_lse:
        empty = torch.empty(0, dtype=torch.float32, device=query.device)
        return out, empty, empty.clone()
    return out, row_max.permute(0, 2, 1, 3).contiguous(), row_sum.permute(0, 2, 1, 3).contiguous()


def _npu_sparse_flash_attention_grad(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None,
                                     sparse_indices: torch.Tensor, d_out: torch.Tensor, out: torch.Tensor,
                                     softmax_max: torch.Tensor, softmax_sum: torch.Tensor, scale_value: float,
                                     sparse_block_size: int, query_rope: torch.Tensor | None = None,
                                     key_rope: torch.Tensor | None = None,
                                     actual_seq_qlen: torch.Tensor | None = None,
                                     actual_seq_kvlen: torch.Tensor | None = None, layout: str | None = "BSND",
                                     sparse_mode: int | None = 3, pre_tokens: int | None = 9223372036854775807,
                                     next_tokens: int | None = 9223372036854775807, attention_mode: int | None = 0
                                     ) -> tuple[torch.Tensor, ...]:
    """(d_query, d_key, d_value, d_query_rope, d_key_rope) of npu_sparse_flash_attention from its softmax statistics:
    the probabilities recomputed as exp(score - softmax_max) / softmax_sum, out giving rowsum(d_out * out); the keys'
    and values' gradients summed over every query that read them. The rope gradients are empty without rope inputs."""
    calls["npu_sparse_flash_attention_grad"] += 1
    op = "npu_sparse_flash_attention_grad"
    if actual_seq_qlen is not None or actual_seq_kvlen is not None:
        raise NotImplementedError(f"fake {op}: actual lengths are not modelled")
    q, k_sel, v_sel, scores, index = _sfa_scores(op, query, key, value, sparse_indices, scale_value, query_rope,
                                                 key_rope, layout, sparse_mode, attention_mode, sparse_block_size)
    b, s1, n2, g, _ = q.shape
    if tuple(softmax_max.shape) != (b, n2, s1, g) or softmax_sum.shape != softmax_max.shape:
        raise RuntimeError(f"{op}: softmax_max / softmax_sum must be [B, N2, S1, G] = {[b, n2, s1, g]}"
                           + cite("sfa.softmax_stats"))
    stat_max, stat_sum = (t.float().permute(0, 2, 1, 3).unsqueeze(-1) for t in (softmax_max, softmax_sum))
    probs = torch.exp(scores - stat_max) / stat_sum
    do = d_out.float().view(b, s1, n2, g, -1)
    delta = (do * out.float().view(b, s1, n2, g, -1)).sum(-1, keepdim=True)
    d_scores = probs * (torch.einsum("bsngd,bsnkd->bsngk", do, v_sel) - delta) * scale_value
    dq = torch.einsum("bsngk,bsnkd->bsngd", d_scores, k_sel).reshape(*query.shape[:3], -1)
    dk_sel = torch.einsum("bsngk,bsngd->bsnkd", d_scores, q)
    dv_sel = torch.einsum("bsngk,bsngd->bsnkd", probs, do)

    def to_keys(per_read: torch.Tensor) -> torch.Tensor:  # [B, S1, N2, K, E] summed into [B, S2, N2, E]
        e = per_read.shape[-1]
        flat = per_read.permute(0, 1, 3, 2, 4).reshape(b, -1, n2, e)
        where = index.permute(0, 1, 3, 2).reshape(b, -1, n2, 1).expand(-1, -1, -1, e)
        return torch.zeros(b, key.shape[1], n2, e, device=query.device).scatter_add_(1, where, flat)

    dk, dv = to_keys(dk_sel), to_keys(dv_sel)
    d = query.shape[-1]
    empty = torch.empty(0, dtype=query.dtype, device=query.device)
    dq_rope = empty if query_rope is None else dq[..., d:].to(query_rope.dtype)
    dk_rope = empty.to(key.dtype) if key_rope is None else dk[..., d:].to(key_rope.dtype)
    return dq[..., :d].to(query.dtype), dk[..., :d].to(key.dtype), dv.to(value.dtype), dq_rope, dk_rope


# The dense warm-up's KL loss kernels, after op-plugin's test/test_custom_ops/
# test_npu_dense_lightning_indexer_grad_kl_loss.py (_process_p, _process_sy, _process_kl_loss, _process_dwqk): BSND,
# one index key head, rightDownCausal (sparse_mode 3) only.


def _dense_index_scores(op: str, query_index: torch.Tensor, key_index: torch.Tensor, weights: torch.Tensor,
                        layout: str | None, sparse_mode: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(I [B, S1, S2] masked with -inf past rightDownCausal, ReLU(q_I . k_I) [B, N1, S1, S2]) in fp32."""
    if layout != "BSND" or sparse_mode != 3:
        raise NotImplementedError(f"fake {op}: only BSND with sparse_mode 3 is modelled")
    for name, t in (("query_index", query_index), ("key_index", key_index)):
        if t.dtype not in DSA_DTYPES:
            raise RuntimeError(f"{op}: {name} must be fp16 or bf16, got {t.dtype}" + cite("kl.dtype"))
    if weights.dtype not in (*DSA_DTYPES, torch.float32) or tuple(weights.shape) != tuple(query_index.shape[:3]):
        raise RuntimeError(f"{op}: weights must be [B, S1, N1index] fp16/bf16/fp32, got {weights.dtype} "
                           f"{list(weights.shape)}" + cite("kl.weights"))
    if key_index.shape[2] != 1:
        raise NotImplementedError(f"fake {op}: only one index key head is modelled")
    relu = torch.einsum("bsnd,btd->bnst", query_index.float(), key_index[:, :, 0].float()).relu()
    scores = (relu * weights.float().permute(0, 2, 1).unsqueeze(-1)).sum(1)
    visible = _right_down_visible(scores.shape[1], scores.shape[2], scores.device)
    return scores.masked_fill(~visible, float("-inf")), relu


def _npu_dense_lightning_indexer_softmax_lse(query_index: torch.Tensor, key_index: torch.Tensor,
                                             weights: torch.Tensor, *, actual_seq_qlen: list[int] | None = None,
                                             actual_seq_klen: list[int] | None = None, layout: str | None = "BSND",
                                             sparse_mode: int | None = 3,
                                             pre_tokens: int | None = 9223372036854775807,
                                             next_tokens: int | None = 9223372036854775807
                                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax_max_index, softmax_sum_index) [B, N2index, S1] fp32: the row max of the indexer's masked scores and
    the sum of exp(score - max)."""
    calls["npu_dense_lightning_indexer_softmax_lse"] += 1
    scores, _ = _dense_index_scores("npu_dense_lightning_indexer_softmax_lse", query_index, key_index, weights,
                                    layout, sparse_mode)
    row_max = scores.amax(-1)
    return row_max.unsqueeze(1), torch.exp(scores - row_max.unsqueeze(-1)).sum(-1).unsqueeze(1)


def _npu_dense_lightning_indexer_grad_kl_loss(
        query: torch.Tensor, key: torch.Tensor, query_index: torch.Tensor, key_index: torch.Tensor,
        weights: torch.Tensor, softmax_max: torch.Tensor, softmax_sum: torch.Tensor, softmax_max_index: torch.Tensor,
        softmax_sum_index: torch.Tensor, scale_value: float, *, query_rope: torch.Tensor | None = None,
        key_rope: torch.Tensor | None = None, actual_seq_qlen: list[int] | None = None,
        actual_seq_klen: list[int] | None = None, layout: str | None = "BSND", sparse_mode: int | None = 3,
        pre_tokens: int | None = 9223372036854775807, next_tokens: int | None = 9223372036854775807
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d_query_index, d_key_index, d_weights, loss [1] fp32): p = the main attention's probabilities from its
    statistics averaged over the N1 heads, y = softmax(I) from the index statistics, loss = sum over B, S1, S2 of
    p (log max(p, 1e-8) - log max(y, 1e-8)), the gradients those of that sum through I."""
    calls["npu_dense_lightning_indexer_grad_kl_loss"] += 1
    op = "npu_dense_lightning_indexer_grad_kl_loss"
    scores, relu = _dense_index_scores(op, query_index, key_index, weights, layout, sparse_mode)
    for name, t in (("query", query), ("key", key), ("query_rope", query_rope), ("key_rope", key_rope)):
        if t is not None and t.dtype not in DSA_DTYPES:
            raise RuntimeError(f"{op}: {name} must be fp16 or bf16, got {t.dtype}" + cite("kl.dtype"))
    q = query if query_rope is None else torch.cat([query, query_rope], dim=-1)
    k = key if key_rope is None else torch.cat([key, key_rope], dim=-1)
    b, s1, n1, _ = q.shape
    n2 = k.shape[2]
    if tuple(softmax_max.shape) != (b, n2, s1, n1 // n2) or softmax_sum.shape != softmax_max.shape:
        raise RuntimeError(f"{op}: softmax_max / softmax_sum must be [B, N2, S1, G] = {[b, n2, s1, n1 // n2]}, got "
                           f"{list(softmax_max.shape)}" + cite("kl.softmax"))
    if tuple(softmax_max_index.shape) != (b, 1, s1) or softmax_sum_index.shape != softmax_max_index.shape:
        raise RuntimeError(f"{op}: softmax_max_index / softmax_sum_index must be [B, N2index, S1] = {[b, 1, s1]}"
                           + cite("kl.softmax_index"))
    main = torch.einsum("bsnd,btnd->bnst", q.float(), k.float().repeat_interleave(n1 // n2, dim=2)) * scale_value
    main = main.masked_fill(~_right_down_visible(s1, k.shape[1], q.device), float("-inf"))
    stat_max = softmax_max.permute(0, 1, 3, 2).reshape(b, n1, s1, 1)
    stat_sum = softmax_sum.permute(0, 1, 3, 2).reshape(b, n1, s1, 1)
    p = (torch.exp(main - stat_max) / stat_sum).sum(1) / n1  # [B, S1, S2]
    y = torch.exp(scores - softmax_max_index[:, 0, :, None]) / softmax_sum_index[:, 0, :, None]
    floor = torch.tensor(1e-8)
    loss = (p * (torch.log(torch.maximum(p, floor)) - torch.log(torch.maximum(y, floor)))).sum()
    diff = y - p  # d loss / d I
    d_weights = (diff.unsqueeze(1) * relu).sum(-1).permute(0, 2, 1)  # [B, S1, N1index]
    d_relu = diff.unsqueeze(1) * weights.float().permute(0, 2, 1).unsqueeze(-1) * (relu > 0)  # [B, N1, S1, S2]
    d_query_index = torch.einsum("bnst,btd->bsnd", d_relu, key_index[:, :, 0].float())
    d_key_index = torch.einsum("bnst,bsnd->btd", d_relu, query_index.float()).unsqueeze(2)
    return (d_query_index.to(query_index.dtype), d_key_index.to(key_index.dtype), d_weights.to(weights.dtype),
            loss.reshape(1))


def _get_npu_format(self: torch.Tensor) -> int:
    """The storage format of a tensor: ND (2) for every tensor the fake makes."""
    return 2


# The torch_npu ops the project calls, each with its CPU kernel. Adding one is a line here (and its kernel).
KERNELS = {
    "get_npu_format": _get_npu_format,  # the fused optimizers of torch_npu.optim call it
    "npu_fusion_attention": _npu_fusion_attention,
    "npu_fusion_attention_grad": _npu_fusion_attention_grad,
    "npu_rms_norm": _npu_rms_norm,
    "npu_rotary_mul": _npu_rotary_mul,
    "npu_swiglu": _npu_swiglu,
    "npu_grouped_matmul": _npu_grouped_matmul,
    "npu_grouped_matmul_add_": _npu_grouped_matmul_add_,
    "npu_moe_gating_top_k_softmax": _npu_moe_gating_top_k_softmax,
    "npu_moe_token_permute": _npu_moe_token_permute,
    "npu_moe_token_unpermute": _npu_moe_token_unpermute,
    "npu_lightning_indexer": _npu_lightning_indexer,
    "npu_sparse_flash_attention": _npu_sparse_flash_attention,
    "npu_sparse_flash_attention_grad": _npu_sparse_flash_attention_grad,
    "npu_dense_lightning_indexer_softmax_lse": _npu_dense_lightning_indexer_softmax_lse,
    "npu_dense_lightning_indexer_grad_kl_loss": _npu_dense_lightning_indexer_grad_kl_loss,
}
# The ops torch_npu registers no backward for: their outputs carry no gradient on a card, nor here.
WITHOUT_AUTOGRAD = ("npu_grouped_matmul", "npu_grouped_matmul_add_", "npu_moe_gating_top_k_softmax")
# Ops defined from the wheel without a kernel yet: the other MoE routing and grouped-matmul ops.
SCHEMA_ONLY = (
    "npu_moe_init_routing_v2", "npu_moe_gating_top_k", "npu_moe_compute_expert_tokens",
    "npu_moe_finalize_routing", "npu_moe_token_permute_with_routing_map", "npu_moe_token_unpermute_with_routing_map",
    "npu_moe_re_routing",
)
npu_wheel.define_ops([*KERNELS, *SCHEMA_ONLY], KERNELS, without_autograd=WITHOUT_AUTOGRAD)
globals().update({name: getattr(torch.ops.npu, name) for name in (*KERNELS, *SCHEMA_ONLY)})  # torch_npu.<op>
