"""`CpuDecodeRunner`: a CPU decode step as one flat run of the layers' ops, without the module tree.

On a GPU the CUDA graph removes the host cost of a decode step. On the CPU there is no graph, and
the module tree's Python was a sixth of a SmolLM2-135M decode step (README, "CPU decode runner"):
thirty layers of `nn.Module` calls, per-call dtype and device checks (`fused_ops_for`), the
attention backend's dispatch and attribute lookups, about 180 us a layer. This runner binds each
layer's weights and ops once, after the weights are packed, and a step calls the same
ops in the same order with the same arguments as the module forward, so its logits are
bit-identical (tests/test_cpu_decode_runner.py). The layer loop itself then runs in C++ as one
`srt_cpu::decode_layers` call (kernels/cpu/csrc/decode_layers.cpp: the same op calls through the
dispatcher, again bit-identical), which removes the interpreter between the ops, about a dozen
calls, views and wrapper frames per layer; the Python loop stays for what that op does not bind
(Qwen3's q/k norms, a tensor-parallel all-reduce, more rows than a bound linear serves) and under
SRT_CPU_DECODE_LAYER_OP=0.

It runs decode on the CPU when every layer is the Llama family's (Llama, Mistral, Qwen2's qkv bias,
Qwen3's q/k norms), the fused C++ ops serve the model's dtype and the paged decode op serves it
with the KV pool's dtype (fp32 or bf16; a pool of the other one, such as --kv-cache-dtype bf16
under fp32 weights, gets each step's K/V rows cast on store, as the pool's `set_kv_buffer` casts
them). It is off under --enable-torch-compile (the compiled forward runs decode) and with
SRT_CPU_DECODE_RUNNER=0. Anything else (extend, mixed batches, a step on another attention backend
than the one bound) runs the module forward.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, List, NamedTuple, Optional

import torch
from torch import nn

from kernels.attention.torch_native_backend import TorchNativeAttnBackend
from srt.environ import envs
from srt.layers.cpu_fused_ops import fused_ops_for
from srt.layers.cpu_weight_packing import DENSE_KERNEL_ROWS, PANEL_DENSE_ROWS, dense_linear
from srt.layers.linear import LinearBase, RowParallelLinear
from srt.layers.logits_processor import LogitsProcessorOutput
from srt.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel

if TYPE_CHECKING:
    from srt.model_executor.forward_batch_info import ForwardBatch
    from srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class _Layer(NamedTuple):
    """One decoder layer, bound: weights, sizes, its layer id (the KV buffers are looked up per step:
    a cache flush replaces them, `release_host_pages`)."""
    ln1: torch.Tensor
    ln2: torch.Tensor
    eps1: float
    eps2: float
    qkv: "_Linear"
    o_proj: "_Linear"
    gate_up: "_Linear"
    down: "_Linear"
    split: List[int]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    project_qk: Optional[Callable]
    cos: torch.Tensor
    sin: torch.Tensor
    layer_id: int
    scaling: float


class _LayerOpArgs(NamedTuple):
    """decode_layers' arguments that stay the same from step to step (in its order)."""
    layer_ids: List[int]
    norms: List[torch.Tensor]
    eps: List[float]
    weights: List[torch.Tensor]
    biases: List[Optional[torch.Tensor]]
    kinds: List[int]
    out_features: List[int]
    cos: List[torch.Tensor]
    sin: List[torch.Tensor]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    kv_dtype: Optional[torch.dtype]


class _Linear(NamedTuple):
    """One linear layer as a decode step runs it: `call(x)`, and how decode_layers (kernels/cpu/csrc/
    decode_layers.cpp) runs the same call: `kind` (its LinearKind; None: only the layer's Python
    can), the weight and bias it passes, the output features, the most rows of x that call serves."""
    call: Callable[[torch.Tensor], torch.Tensor]
    kind: Optional[int] = None
    weight: Optional[torch.Tensor] = None
    bias: Optional[torch.Tensor] = None
    out_features: int = 0
    max_rows: int = 0


_PANELS, _AMX, _DENSE, _ONEDNN, _PLAIN, _ONEDNN_CAST = range(6)  # decode_layers.cpp's LinearKind
_ANY_ROWS = 1 << 62  # a call with no row bound


def _bind_linear(module: LinearBase, dtype: torch.dtype) -> _Linear:
    """`module(x)` as one call: the AMX tile kernel, the dense fp32 dispatch or oneDNN's packed linear
    directly where the weight is packed for them in the model's dtype (what `packed_linear` runs for
    it), the layer's own code otherwise."""
    row_parallel = isinstance(module, RowParallelLinear)
    if row_parallel and (module.tp_size > 1 or module.bias is not None):
        return _Linear(module.forward)  # all-reduce, then the bias
    packed, bias = module.packed_weight, module.bias
    n = module.output_size
    if packed is not None and packed.dim() == 5 and dtype == torch.bfloat16:  # AMX tiles (kernels/cpu/gemm.py)
        amx_linear = torch.ops.srt_cpu.amx_linear
        return _Linear(lambda x: amx_linear(x, packed, bias, None), _AMX, packed, bias, n, _ANY_ROWS)
    if packed is not None and packed.dim() == 2 and not packed.is_mkldnn and dtype == torch.float32:  # dense fp32
        return _Linear(lambda x: dense_linear(x, packed, bias), _DENSE, packed, bias, n, DENSE_KERNEL_ROWS)
    if packed is not None and packed.is_mkldnn and packed.dtype == dtype:
        linear = torch.ops.mkldnn._linear_pointwise
        return _Linear(lambda x: linear(x, packed, bias, "none", [], ""), _ONEDNN, packed, bias, n, _ANY_ROWS)
    call = lambda x: module.matmul(x, bias)  # noqa: E731
    if packed is None:
        return _Linear(call, _PLAIN, module.weight, bias, n, _ANY_ROWS)
    if packed.dim() == 3 and not packed.is_mkldnn:  # panels: packed_linear's op below its BLAS rows
        n = module.packed_out_features or packed.shape[0] * packed.shape[2]
        return _Linear(call, _PANELS, packed, bias, n, PANEL_DENSE_ROWS - 1)
    if packed.is_mkldnn:  # oneDNN's layout in another dtype (bf16 weights widened to fp32)
        return _Linear(call, _ONEDNN_CAST, packed, bias, n, _ANY_ROWS)
    return _Linear(call)


def _unsupported(model: nn.Module) -> Optional[str]:
    """Why the runner cannot stand in for this model's decode forward, or None."""
    if not isinstance(model, LlamaForCausalLM) or type(model).forward is not LlamaForCausalLM.forward:
        return f"{type(model).__name__} is not a Llama-family model"
    if not isinstance(model.model, LlamaModel) or type(model.model).forward is not LlamaModel.forward:
        return f"{type(model.model).__name__} has its own forward"
    for layer in model.model.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if (not isinstance(layer, LlamaDecoderLayer) or type(layer).forward is not LlamaDecoderLayer.forward
                or not isinstance(attn, LlamaAttention) or type(attn).forward is not LlamaAttention.forward
                or not isinstance(mlp, LlamaMLP) or type(mlp).forward is not LlamaMLP.forward):
            return f"layer {type(layer).__name__} differs from Llama's"
    return None


class CpuDecodeRunner:
    def __init__(self, runner: "ModelRunner"):
        model, dtype = runner.model, runner.dtype
        self.model = model
        self.ops = torch.ops.srt_cpu
        self.backend = runner.attn_backend
        self.paged_decode = runner.attn_backend.paged_decode
        store_dtype = runner.token_to_kv_pool.store_dtype
        self.kv_cast = None if store_dtype == dtype else store_dtype
        self.layers: List[_Layer] = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            project_qk = None if type(attn).project_qk is LlamaAttention.project_qk else attn.project_qk
            layer_id = attn.attn.layer_id
            self.layers.append(_Layer(
                ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
                eps1=layer.input_layernorm.variance_epsilon, eps2=layer.post_attention_layernorm.variance_epsilon,
                qkv=_bind_linear(attn.qkv_proj, dtype), o_proj=_bind_linear(attn.o_proj, dtype),
                gate_up=_bind_linear(mlp.gate_up_proj, dtype), down=_bind_linear(mlp.down_proj, dtype),
                split=[attn.q_size, attn.kv_size, attn.kv_size], num_heads=attn.num_heads,
                num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, project_qk=project_qk,
                cos=attn.rotary_emb.cos_cache, sin=attn.rotary_emb.sin_cache,
                layer_id=layer_id, scaling=attn.attn.scaling,
            ))
        self.layer_args: Optional[_LayerOpArgs] = None
        self.layer_op_rows = 0  # the most rows of a step the C++ layer loop serves (its linears' bound)
        self.why_no_layer_op = self._bind_layer_op()
        self.use_layer_op = self.why_no_layer_op is None  # a benchmark may turn it off to compare

    def _bind_layer_op(self) -> Optional[str]:
        """decode_layers' per-layer arguments (kernels/cpu/csrc/decode_layers.cpp: the Python loop of
        `forward` in one C++ call); why it cannot run this model, or None."""
        if not envs.CPU_DECODE_LAYER_OP.get():
            return "SRT_CPU_DECODE_LAYER_OP=0"
        try:
            torch.ops.srt_cpu.decode_layers
        except (AttributeError, RuntimeError):
            return "the C++ library has no decode_layers op"
        first = self.layers[0]
        shape = (first.num_heads, first.num_kv_heads, first.head_dim, first.scaling)
        for layer in self.layers:
            if layer.project_qk is not None:
                return "the model projects q and k in Python (q/k norms)"
            if (layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.scaling) != shape:
                return "the layers' attention shapes differ"
            if layer.split != [layer.num_heads * layer.head_dim] + [layer.num_kv_heads * layer.head_dim] * 2:
                return "the qkv split is not heads x head_dim"
        linears = [lin for layer in self.layers for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
        if any(lin.kind is None for lin in linears):
            return "a linear runs its own Python (a tensor-parallel all-reduce, or a weight packed for another dtype)"
        self.layer_op_rows = min(lin.max_rows for lin in linears)
        self.layer_args = _LayerOpArgs(
            layer_ids=[layer.layer_id for layer in self.layers],
            norms=[w for layer in self.layers for w in (layer.ln1, layer.ln2)],
            eps=[float(e) for layer in self.layers for e in (layer.eps1, layer.eps2)],
            weights=[lin.weight for lin in linears], biases=[lin.bias for lin in linears],
            kinds=[lin.kind for lin in linears], out_features=[lin.out_features for lin in linears],
            cos=[layer.cos for layer in self.layers], sin=[layer.sin for layer in self.layers],
            num_heads=shape[0], num_kv_heads=shape[1], head_dim=shape[2], scaling=float(shape[3]),
            kv_dtype=self.kv_cast)
        return None

    @classmethod
    def maybe_create(cls, runner: "ModelRunner") -> Optional["CpuDecodeRunner"]:
        """The runner for this model, or None (logged at debug level: why not)."""
        why = cls.why_not(runner)
        if why is not None:
            logger.debug("Decode runs through the module tree: %s.", why)
            return None
        decode_runner = cls(runner)
        how = ("run as one C++ call, SRT_CPU_DECODE_LAYER_OP=0 runs them in Python" if decode_runner.use_layer_op
               else f"run in Python: {decode_runner.why_no_layer_op}")
        logger.info("CPU decode runner: %d layers bound for decode, %s (SRT_CPU_DECODE_RUNNER=0 runs decode "
                    "through the module tree).", len(decode_runner.layers), how)
        return decode_runner

    @staticmethod
    def why_not(runner: "ModelRunner") -> Optional[str]:
        if not envs.CPU_DECODE_RUNNER.get():
            return "SRT_CPU_DECODE_RUNNER=0"
        if runner.device != "cpu":
            return f"the device is {runner.device}"
        if runner.server_args.enable_torch_compile:
            return "--enable-torch-compile runs decode through the compiled forward"
        backend = runner.attn_backend
        if not isinstance(backend, TorchNativeAttnBackend) or backend.paged_decode is None:
            return "the C++ paged decode op does not serve this model and pool"
        why = _unsupported(runner.model)
        if why is not None:
            return why
        layer = runner.model.model.layers[0]
        probe = torch.empty(0, dtype=runner.dtype, device=runner.device)
        if fused_ops_for(probe, layer.input_layernorm.weight, layer.self_attn.rotary_emb.cos_cache) is None:
            return "the fused C++ ops (RMSNorm, RoPE, SiLU-and-mul) do not serve this model"
        return None

    def can_run(self, fb: "ForwardBatch") -> bool:
        """A decode step on the backend this runner bound (a benchmark may swap the backend)."""
        return fb.forward_mode.is_decode() and fb.attn_backend is self.backend

    def forward(self, fb: "ForwardBatch") -> LogitsProcessorOutput:
        """The decode forward of `LlamaForCausalLM`, op for op (the backend's metadata is set)."""
        model = self.model
        hidden = model.model.embed_tokens(fb.input_ids)
        a = self.layer_args
        if a is not None and self.use_layer_op and hidden.shape[0] <= self.layer_op_rows:
            pool = fb.token_to_kv_pool
            hidden, residual = self.ops.decode_layers(
                hidden, fb.positions, fb.out_cache_loc, fb.req_to_token_pool.req_to_token, fb.req_pool_indices,
                fb.seq_lens, pool.k_buffer, pool.v_buffer, a.layer_ids, a.norms, a.eps, a.weights, a.biases, a.kinds,
                a.out_features, a.cos, a.sin, a.num_heads, a.num_kv_heads, a.head_dim, a.scaling, a.kv_dtype)
        else:
            hidden, residual = self._layers(fb, hidden)
        hidden, _ = model.model.norm(hidden, residual)
        return model.logits_processor(hidden, model.lm_head, fb)

    def _layers(self, fb: "ForwardBatch", hidden: torch.Tensor):
        """The layers in Python: (hidden, residual) before the final norm."""
        ops = self.ops
        positions, loc = fb.positions, fb.out_cache_loc
        req_to_token, rows, seq_lens = fb.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.seq_lens
        k_buffers, v_buffers = fb.token_to_kv_pool.k_buffer, fb.token_to_kv_pool.v_buffer
        residual = None
        for layer in self.layers:
            if residual is None:
                residual = hidden
                hidden, _ = ops.rms_norm(hidden, None, layer.ln1, layer.eps1)
            else:
                hidden, residual = ops.rms_norm(hidden, residual, layer.ln1, layer.eps1)
            q, k, v = layer.qkv.call(hidden).split(layer.split, dim=-1)
            q = q.reshape(-1, layer.num_heads, layer.head_dim)
            k = k.reshape(-1, layer.num_kv_heads, layer.head_dim)
            if layer.project_qk is not None:
                q, k = layer.project_qk(q, k)
            q, k = ops.rotary_embedding(positions, q, k, layer.cos, layer.sin)
            k_buffer, v_buffer = k_buffers[layer.layer_id], v_buffers[layer.layer_id]
            v = v.reshape(-1, layer.num_kv_heads, layer.head_dim)
            if self.kv_cast is not None:
                k, v = k.to(self.kv_cast), v.to(self.kv_cast)
            ops.store_kv(k_buffer, v_buffer, loc, k, v)
            q = q.reshape(-1, layer.split[0]).reshape(-1, layer.num_heads, layer.head_dim)
            out = self.paged_decode(q, k_buffer, v_buffer, req_to_token, rows, seq_lens, layer.scaling)
            hidden = layer.o_proj.call(out.view(-1, layer.split[0]))
            hidden, residual = ops.rms_norm(hidden, residual, layer.ln2, layer.eps2)
            hidden = layer.down.call(ops.silu_and_mul(layer.gate_up.call(hidden)))
        return hidden, residual
