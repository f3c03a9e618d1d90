"""What a decoder layer's steps run on: one `Ops` family chosen per device (`select_ops`).

- `TorchOps`: plain torch, the CPU path and the oracle of the kernel tests.
- `TritonOps` (CUDA): fused Triton kernels: RMSNorm + residual add and SiLU-and-mul in one launch
  each, q/k-norm, rotary and the KV store in one.
- `Batch1Ops` (CUDA, one token: a batch-1 decode step): at batch 1 a step is a few hundred small
  kernels between the weight reads, and their launch gaps, not the arithmetic, separate it from the
  bandwidth floor. The norms run in the prologues of the q/k/v and gate/up GEMVs, SiLU-and-mul in
  the down GEMV's, the residual adds in the epilogues of o and down (kernels/triton_gemv.py), and
  the decode attention kernel does the q/k/v kernel's work: six kernels a layer (four GEMVs,
  attention and its merge). With `kernels.persistent_decoder`, one persistent kernel runs every
  layer instead (`all_layers`, kernels/triton_decoder.py).

A layer passes (h, residual): the residual stream and the block's output still to be added, which
the next norm adds in (`norm_project`). Batch1Ops adds in place and leaves h None.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from flashstack.cuda.torch_interop import device_for
from flashstack.engine.config import KernelOptions
from flashstack.engine.kernels.attention import AttentionBackend, AttentionMetadata
from flashstack.engine.models.layers import apply_rotary
from flashstack.engine.quantization import (
    FP8,
    FP8_ACT_MAX_ROWS,
    fp8_activations_linear,
)

if TYPE_CHECKING:
    from flashstack.engine.kernels.triton_decoder import PersistentDecoder
    from flashstack.engine.kernels.triton_skinny import SplitK
    from flashstack.engine.models.layers import RMSNorm
    from flashstack.engine.models.linear import Linear
    from flashstack.engine.models.llama import Attention, DecoderModel, GatedMLP

log = logging.getLogger(__name__)

Rope = tuple[torch.Tensor, torch.Tensor]
# (h, residual); h may be a split product's unsummed slices, which the next norm adds (TritonOps)
Stream = tuple["torch.Tensor | SplitK | None", torch.Tensor]


class TorchOps:
    """Plain torch, with `backend`'s attention kernels."""

    def __init__(self, backend: AttentionBackend) -> None:
        self.backend = backend
        self.kernels: KernelOptions = backend.kernels

    def for_tokens(self, num_tokens: int) -> TorchOps:
        """The ops for a step of `num_tokens` tokens (Batch1Ops where it applies)."""
        return self

    def all_layers(
        self,
        model: DecoderModel,
        h: torch.Tensor,
        rope: Rope,
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor | None:
        """The residual stream after every decoder layer at once, before the final norm, where one
        kernel runs them all (Batch1Ops); None: the layers run one by one."""
        return None

    def norm_project(
        self, norm: RMSNorm, proj: Linear, h: torch.Tensor | None, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """proj(norm(residual + h)) and the new residual (h itself before the first layer)."""
        assert h is not None
        residual = h if residual is None else residual + h
        return self._linear(proj, norm(residual)), residual

    def _fp8_activations(self, proj: Linear, rows: int) -> bool:
        """Whether this product quantizes its activations to fp8 (KernelOptions.fp8_activations):
        fp8 weights, 2 to FP8_ACT_MAX_ROWS rows, one device."""
        return (
            self.kernels.fp8_activations
            and proj.weight.dtype == FP8
            and proj.tp is None
            and 2 <= rows <= FP8_ACT_MAX_ROWS
        )

    def _linear(self, proj: Linear, x: torch.Tensor) -> torch.Tensor:
        if self._fp8_activations(proj, x.shape[0]):
            return fp8_activations_linear(x, proj.weight, proj.weight_scale, proj.bias)
        return proj(x)

    def attend(
        self,
        attn: Attention,
        qkv: torch.Tensor,
        rope: Rope,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Norms, rotary, KV store and attention from the packed q/k/v projection's output; the
        heads' outputs [tokens, heads * head_dim], before o_proj."""
        q, k, v = attn.split_qkv(qkv)
        if attn.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rotary(q, k, *rope)
        self.backend.store_kvcache(k, v, kv_cache, meta.slot_mapping, attn.kv_scale)
        return self.backend.attend(
            q, kv_cache, meta, attn.scale, attn.sliding_window, attn.kv_scale
        ).reshape(qkv.shape[0], -1)

    def project_add(
        self, proj: Linear, x: torch.Tensor, residual: torch.Tensor, silu: bool = False
    ) -> Stream:
        """proj(x) (of silu(gate) * up when `silu`), to be added to the residual by the next
        norm."""
        if silu:
            gate, up = x.chunk(2, dim=-1)
            x = nn.functional.silu(gate) * up
        return self._linear(proj, x), residual

    def feed_forward(
        self, norm: RMSNorm, mlp: GatedMLP, h: torch.Tensor | SplitK | None, residual: torch.Tensor
    ) -> Stream:
        """The MLP of norm(residual + h): down(silu(gate) * up), to be added to the residual by the
        next norm."""
        gate_up, residual = self.norm_project(norm, mlp.gate_up_proj, h, residual)
        return self.project_add(mlp.down_proj, gate_up, residual, silu=True)

    def final_norm(
        self, norm: RMSNorm, h: torch.Tensor | None, residual: torch.Tensor
    ) -> torch.Tensor:
        """The decoder's output: the final norm of the residual stream."""
        assert h is not None
        return norm(residual + h)

    def logits(self, head: Linear, hidden: torch.Tensor) -> torch.Tensor | None:
        """Vocabulary logits (None on a tensor-parallel rank other than 0)."""
        return head(hidden)


class TritonOps(TorchOps):
    """The fused Triton kernels (CUDA, a power-of-two head size for the rotary kernel)."""

    def __init__(self, backend: AttentionBackend) -> None:
        super().__init__(backend)
        # The Triton attention backend also takes rotary and the KV store in its q/k/v kernel.
        self.triton_attention = backend.name == "triton"
        self.batch1 = (
            Batch1Ops(backend) if self.triton_attention and self.kernels.triton_gemv else None
        )

    def for_tokens(self, num_tokens: int) -> TorchOps:
        return self.batch1 if num_tokens == 1 and self.batch1 is not None else self

    def _linear(self, proj: Linear, x: torch.Tensor) -> torch.Tensor:
        y = self._product(proj, x)
        assert isinstance(y, torch.Tensor)
        return y

    def _takes_skinny(self, proj: Linear, rows: int) -> bool:
        """Whether a product of `rows` rows with proj's weight takes the skinny GEMM: one GPU,
        16-bit, Q8_0, Q4_K or fp8 weights (fp8 where the device has fp8 tensor cores), few rows."""
        from flashstack.engine.kernels.triton_skinny import fp8_tensor_cores, skinny_applies

        fp8 = proj.weight.dtype == FP8
        blocks = proj.weight.dtype in (torch.int8, torch.uint8) or fp8
        return (
            proj.tp is None
            and self.kernels.skinny_gemm
            and (proj.weight_scale is None or blocks)
            and not (fp8 and not fp8_tensor_cores(proj.weight.device))
            and skinny_applies(
                rows,
                proj.out_features,
                proj.in_features,
                blocks=blocks,
                small_weights=self.kernels.skinny_small_weights,
            )
        )

    def _product(
        self, proj: Linear, x: torch.Tensor, into_norm: bool = False, gated: bool = False
    ) -> torch.Tensor | SplitK:
        # into_norm: the output only feeds an RMSNorm, which can add a split product's slices
        # itself (KernelOptions.split_k_in_norm). gated: a gate/up product whose skinny GEMM
        # returns silu(gate) * up (`_gated`).
        if proj.tp is not None:
            return proj(x)  # a row-parallel layer reduces across ranks in its forward
        from flashstack.engine.kernels.triton_skinny import fp8_tensor_cores, skinny_linear

        # Q8_0, Q4_K and fp8 W8A16: the skinny GEMM dequantizes in registers; fp8 W8A8: no
        # conversion, the fp8 tensor cores (Ada, Hopper and later; elsewhere plain torch's W8A8)
        fp8 = proj.weight.dtype == FP8
        act8 = self._fp8_activations(proj, x.shape[0])
        if fp8 and not fp8_tensor_cores(x.device):
            return super()._linear(proj, x)
        if x.stride(-1) == 1 and self._takes_skinny(proj, x.shape[0]):  # a weight stream
            return skinny_linear(
                x,
                proj.weight,
                proj.bias,
                pdl=self.kernels.pdl,
                scale=proj.weight_scale,
                fp8_activations=act8,
                keep_slices=into_norm and self.kernels.split_k_in_norm,
                gated=gated,
            )
        assert not gated, "silu(gate) * up in the epilogue: the skinny GEMM only (_gated)"
        if act8:  # the skinny GEMM is off: the same numbers in plain torch
            return super()._linear(proj, x)
        if not self.kernels.triton_gemv:
            return proj(x)
        from flashstack.engine.kernels.triton_gemv import linear

        # one-row products: the Triton GEMV
        return linear(x, proj.weight, proj.bias, pdl=self.kernels.pdl, scale=proj.weight_scale)

    def _norm(
        self, norm: RMSNorm, h: torch.Tensor | SplitK | None, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + h), residual + h): the next product's input and the new residual."""
        from flashstack.engine.kernels.triton_elementwise import rmsnorm_triton

        assert h is not None
        out, new_residual = rmsnorm_triton(
            h, norm.weight, norm.eps, residual, pdl=self.kernels.elementwise_pdl
        )
        return out, (h if residual is None else new_residual)

    def norm_project(
        self,
        norm: RMSNorm,
        proj: Linear,
        h: torch.Tensor | SplitK | None,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, residual = self._norm(norm, h, residual)
        return self._linear(proj, out), residual

    def attend(
        self,
        attn: Attention,
        qkv: torch.Tensor,
        rope: Rope,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        from flashstack.engine.kernels.triton_elementwise import rmsnorm_triton, rope_triton

        n = qkv.shape[0]
        q, k, v = attn.split_qkv(qkv)
        cos, sin = rope
        norms = (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps) if attn.qk_norm else ()
        if self._decode_qkv(meta, n):
            # The decode kernel rotates q/k and stores the new k/v itself: one launch for it all.
            # 8B step: batch 1 4.30 -> 4.24 ms on the H200, batch 8 / 32 0.6-1 % faster on the
            # H100; past 32 rows slower (KernelOptions.decode_qkv_rows).
            from flashstack.engine.kernels.triton_attention import (
                NewTokens,
                paged_decode_triton,
                plan_step_decode,
                step_order,
            )

            plan = plan_step_decode(meta, kv_cache, self.kernels)
            order, ready = step_order(meta, meta.context_lens, plan)
            out = paged_decode_triton(
                q,
                kv_cache,
                meta.block_tables,
                meta.context_lens,
                attn.scale,
                plan,
                attn.sliding_window,
                new=NewTokens(k, v, cos, sin, meta.slot_mapping, *norms),
                kv_scale=attn.kv_scale,
                order=order,
                order_ready=ready,
            )
            return out.reshape(n, -1)
        if self.triton_attention:  # one launch for q/k-norm, rotary and the KV store
            from flashstack.engine.kernels.triton_qkv import rope_and_store_kv_triton

            q = rope_and_store_kv_triton(
                q,
                k,
                v,
                cos,
                sin,
                kv_cache,
                meta.slot_mapping,
                *norms,
                kv_scale=attn.kv_scale,
                pdl=self.kernels.elementwise_pdl,
            )
        else:
            if attn.qk_norm:
                q = rmsnorm_triton(q, attn.q_norm.weight, attn.q_norm.eps)[0]
                k = rmsnorm_triton(k, attn.k_norm.weight, attn.k_norm.eps)[0]
            q, k = rope_triton(q, k, cos, sin)
            self.backend.store_kvcache(k, v, kv_cache, meta.slot_mapping, attn.kv_scale)
        return self.backend.attend(
            q, kv_cache, meta, attn.scale, attn.sliding_window, attn.kv_scale
        ).reshape(n, -1)

    def _decode_qkv(self, meta: AttentionMetadata, rows: int) -> bool:
        # whether this step's decode kernel takes the q/k/v kernel's work (KernelOptions.decode_qkv)
        fused = self.kernels.decode_qkv and rows <= self.kernels.decode_qkv_rows
        return self.triton_attention and meta.is_decode_only and fused

    def _gated(self, proj: Linear, rows: int) -> bool:
        """Whether the gate/up product of `rows` rows takes silu(gate) * up in its skinny GEMM's
        epilogue (KernelOptions.gate_up_swiglu): where `_product` takes the skinny GEMM, in one
        K slice."""
        from flashstack.engine.kernels.triton_skinny import gated_fits

        return (
            self.kernels.gate_up_swiglu
            and self._takes_skinny(proj, rows)
            and gated_fits(
                rows, proj.out_features, proj.in_features, self._fp8_activations(proj, rows)
            )
        )

    def feed_forward(
        self, norm: RMSNorm, mlp: GatedMLP, h: torch.Tensor | SplitK | None, residual: torch.Tensor
    ) -> Stream:
        if not self._gated(mlp.gate_up_proj, residual.shape[0]):
            return super().feed_forward(norm, mlp, h, residual)
        out, residual = self._norm(norm, h, residual)
        act = self._product(mlp.gate_up_proj, out, gated=True)
        return self.project_add(mlp.down_proj, act, residual)

    def project_add(
        self, proj: Linear, x: torch.Tensor, residual: torch.Tensor, silu: bool = False
    ) -> Stream:
        if silu:
            from flashstack.engine.kernels.triton_elementwise import silu_and_mul_triton

            x = silu_and_mul_triton(x, pdl=self.kernels.elementwise_pdl)
        return self._product(proj, x, into_norm=True), residual

    def final_norm(
        self, norm: RMSNorm, h: torch.Tensor | SplitK | None, residual: torch.Tensor
    ) -> torch.Tensor:
        from flashstack.engine.kernels.triton_elementwise import rmsnorm_triton

        assert h is not None
        return rmsnorm_triton(h, norm.weight, norm.eps, residual, self.kernels.elementwise_pdl)[0]

    def logits(self, head: Linear, hidden: torch.Tensor) -> torch.Tensor | None:
        from flashstack.engine.models.parallel import ParallelLMHead

        if isinstance(head, ParallelLMHead):  # the vocabulary-parallel head gathers on rank 0
            return head.gathered(hidden, gemv=self.kernels.triton_gemv)
        return self._linear(head, hidden)


class Batch1Ops(TritonOps):
    """One token: the residual stream is one row that every layer adds into (in place on one GPU,
    through the all-reduce under tensor parallelism: `project_add`). Same rounding as TritonOps on
    one GPU (kernels/triton_gemv.py).

    With KernelOptions.fused_mlp an MLP is one kernel (kernels/triton_mlp.py) whose output is a
    float32 row, one a layer, zeroed as a step starts; the stream carries it as h, and the next
    layer's q/k/v GEMV (its norm's input) and o GEMV (into the residual) take it in, or the final
    norm."""

    def __init__(self, backend: AttentionBackend) -> None:
        TorchOps.__init__(self, backend)
        self.triton_attention, self.batch1 = True, None
        # the persistent decoder of each (model, KV caches), None where it does not apply
        self._decoders: dict[tuple[int, int], PersistentDecoder | None] = {}
        # fused_mlp: each model's rows [layers, 1, hidden], this step's, and the next row to use
        self._mlp_sums: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._step_sums: torch.Tensor | None = None
        self._next_sum = 0
        # an MLP's row the q/k/v GEMV has read and the o GEMV is still to add into the residual
        self._pending: torch.Tensor | None = None
        self._mlp_refused: set[str] = set()  # why fused_mlp left MLPs alone, each logged once

    def _start_step(self, model: DecoderModel, h: torch.Tensor) -> None:
        """A step's first layer is next: its MLPs' rows zeroed (fused_mlp)."""
        self._pending, self._next_sum, self._step_sums = None, 0, None
        if not self.kernels.fused_mlp or self.kernels.persistent_decoder:
            # the persistent decoder runs the MLPs itself (KernelOptions.persistent_decoder)
            return
        key = (id(model), h.device)
        if key not in self._mlp_sums:
            rows = (len(model.layers), 1, h.shape[-1])
            self._mlp_sums[key] = torch.zeros(rows, dtype=torch.float32, device=h.device)
        self._step_sums = self._mlp_sums[key]
        self._step_sums.zero_()

    def _mlp_refusal(self, mlp: GatedMLP, residual: torch.Tensor) -> str | None:
        """Why fused_mlp_triton cannot take this MLP (None: it can)."""
        from flashstack.engine.kernels.triton_mlp import fused_mlp_applies

        gate_up, down = mlp.gate_up_proj, mlp.down_proj
        if gate_up.tp is not None or down.tp is not None:
            return "tensor parallelism"
        if gate_up.weight_scale is not None or down.weight_scale is not None:
            return "quantized MLP weights"
        if gate_up.bias is not None or down.bias is not None:
            return "MLP biases"
        if residual.dtype != gate_up.weight.dtype:
            return "activations and weights of different dtypes"
        if not fused_mlp_applies(residual.shape[-1], gate_up.weight, down.weight):
            return f"hidden size {residual.shape[-1]} past what a program holds (1,024)"
        return None

    def _fuses_mlp(self, mlp: GatedMLP, residual: torch.Tensor) -> bool:
        if self._step_sums is None:
            return False
        reason = self._mlp_refusal(mlp, residual)
        if reason is not None and reason not in self._mlp_refused:
            self._mlp_refused.add(reason)
            log.info("kernels.fused_mlp off for this model: %s", reason)
        return reason is None

    def feed_forward(
        self, norm: RMSNorm, mlp: GatedMLP, h: torch.Tensor | SplitK | None, residual: torch.Tensor
    ) -> Stream:
        if not self._fuses_mlp(mlp, residual):
            return super().feed_forward(norm, mlp, h, residual)
        from flashstack.engine.kernels.triton_mlp import fused_mlp_triton

        assert h is None and self._step_sums is not None, "o added into the residual in place"
        row = self._step_sums[self._next_sum]
        self._next_sum += 1
        weights = (mlp.gate_up_proj.weight, mlp.down_proj.weight)
        fused_mlp_triton(residual, (norm.weight, norm.eps), *weights, row, self.kernels.pdl)
        return row, residual

    def for_tokens(self, num_tokens: int) -> TorchOps:
        return self

    def all_layers(
        self,
        model: DecoderModel,
        h: torch.Tensor,
        rope: Rope,
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor | None:
        """Every layer in one persistent kernel (KernelOptions.persistent_decoder)."""
        self._start_step(model, h)
        if not self.kernels.persistent_decoder:
            return None
        key = (id(model), kv_caches[0].data_ptr())
        if key not in self._decoders:
            self._decoders[key] = self._persistent_decoder(model, kv_caches)
        decoder = self._decoders[key]
        if decoder is None:
            return None
        cos, sin = rope
        out = decoder.run(
            h,
            cos,
            sin,
            meta.slot_mapping,
            meta.block_tables[0],
            meta.context_lens,
            model.args.rms_norm_eps,
        )
        if decoder.checked:
            return out
        # Its first run (a graph's warm-up, before any capture) against the layers one by one:
        # a decoder that stalls or disagrees is dropped, loudly, rather than trusted.
        decoder.checked = True
        residual = None
        for layer, kv_cache in zip(model.layers, kv_caches):  # the same KV rows again
            h, residual = layer(h, residual, rope, meta, kv_cache, self)
        assert residual is not None
        problem = decoder.disagreement(out, residual)
        if problem is None:
            return out
        log.error("persistent decoder %s: its layers run one by one from now on", problem)
        self._decoders[key] = None
        return residual

    def _persistent_decoder(
        self, model: DecoderModel, kv_caches: list[torch.Tensor]
    ) -> PersistentDecoder | None:
        from flashstack.engine.kernels.triton_decoder import (
            PersistentDecoder,
            plan_launch,
            unsupported,
        )

        a, k = model.args, self.kernels
        reason = unsupported(a, model.layers, kv_caches)
        if reason is not None:
            log.info("persistent decoder off for this model: %s", reason)
            return None
        sms = device_for(kv_caches[0].device).sm_count if kv_caches[0].is_cuda else 1
        launch = plan_launch(
            a,
            sms,
            programs_per_sm=k.persistent_decoder_programs_per_sm,
            num_warps=k.persistent_decoder_warps,
            tagged=k.persistent_decoder_tagged,
        )
        return PersistentDecoder(a, model.layers, kv_caches, launch)

    def norm_project(
        self, norm: RMSNorm, proj: Linear, h: torch.Tensor | None, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from flashstack.engine.kernels.triton_gemv import gemv_triton

        if residual is None:  # the embedding row, fresh from the lookup: ours to add into
            assert h is not None
            residual, h = h, None
        self._pending = h  # a fused MLP's row, for the o GEMV to add into the residual
        out = gemv_triton(
            proj.weight,
            residual,
            proj.bias,
            norm=(norm.weight, norm.eps),
            pdl=self.kernels.pdl,
            scale=proj.weight_scale,
            l2_prefetch_bytes=self.kernels.gemv_l2_prefetch_bytes,
            pending=h,
        )
        return out, residual

    def project_add(
        self, proj: Linear, x: torch.Tensor, residual: torch.Tensor, silu: bool = False
    ) -> Stream:
        """residual + proj(x) for the o and down projections; h is None after it.

        On one GPU the GEMV adds into the residual in place. A row-parallel projection (tensor
        parallelism) holds a slice of the input features, so each rank's GEMV gives a partial sum:
        the driver's also carries the residual (and the bias), so the all-reduce of the partials is
        the new residual, with no separate add. The partials go straight into the buffer the
        all-reduce pushes from."""
        from flashstack.engine.kernels.triton_gemv import HALF_INPUT_SCALE, gemv_triton

        pdl, tp = self.kernels.pdl, proj.tp
        pending, self._pending = (None, self._pending) if silu else (self._pending, None)
        assert pending is None or tp is None, "fused MLPs run on one GPU"
        prescaled = (  # one GPU: quantized weights refuse tensor parallelism (EngineConfig)
            silu
            and tp is None
            and self.kernels.fp8_silu_kernel
            and proj.weight.dtype == FP8
            and x.dtype != torch.float32
        )
        if prescaled:  # the input once, in the float16 the fp8 products take (KernelOptions)
            from flashstack.engine.kernels.triton_elementwise import silu_and_mul_triton

            x = silu_and_mul_triton(
                x,
                pdl=self.kernels.elementwise_pdl,
                out_dtype=torch.float16,
                out_scale=HALF_INPUT_SCALE,
            )
            silu = False
        if tp is None:
            return None, gemv_triton(
                proj.weight,
                x,
                proj.bias,
                silu=silu,
                residual=residual,
                pdl=pdl,
                scale=proj.weight_scale,
                prescaled=prescaled,
                l2_prefetch_bytes=self.kernels.gemv_l2_prefetch_bytes,
                pending=pending,
            )
        driver = tp.is_driver
        fast = tp.fast is not None and tp.fast.fits_shape(tuple(residual.shape), residual.dtype)
        staged = tp.fast.stage(tuple(residual.shape)) if fast else torch.empty_like(residual)
        gemv_triton(
            proj.weight,
            x,
            proj.bias if driver else None,
            silu=silu,
            residual=residual if driver else None,
            out=staged,
            pdl=pdl,
        )
        if fast:
            return None, tp.fast.reduce(staged)
        dist.all_reduce(staged, group=tp.group)
        return None, staged

    def final_norm(
        self, norm: RMSNorm, h: torch.Tensor | None, residual: torch.Tensor
    ) -> torch.Tensor:
        from flashstack.engine.kernels.triton_elementwise import rmsnorm_triton
        from flashstack.engine.kernels.triton_skinny import SplitK

        pdl = self.kernels.elementwise_pdl
        if h is None:
            return rmsnorm_triton(residual, norm.weight, norm.eps, pdl=pdl)[0]
        # the last MLP's row, one float32 slice, added to the residual as the GEMVs add it
        self._pending = None
        return rmsnorm_triton(
            SplitK(h[None], residual.dtype), norm.weight, norm.eps, residual, pdl
        )[0]


Ops = TorchOps


def select_ops(device: torch.device, backend: AttentionBackend, head_dim: int) -> TorchOps:
    """The ops for a model on `device`: Triton's on CUDA (its rotary kernel works on power-of-two
    halves), plain torch elsewhere."""
    if device.type == "cuda" and not head_dim & (head_dim - 1):
        return TritonOps(backend)
    return TorchOps(backend)
