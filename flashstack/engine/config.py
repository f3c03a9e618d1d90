"""Engine configuration: one slots dataclass that flows through every engine component."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch-free at import: the gateway checks a local model's options with these
    import torch

TP_ALL_REDUCES = ("push", "nccl")
QUANTIZATIONS = (None, "fp8", "q8_0", "q4_k")
DEFAULT_TP_TIMEOUT_S = 300.0
KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass(slots=True, frozen=True)
class KernelOptions:
    """Which kernel variants the engine runs. The defaults are the fastest measured
    (docs/benchmarks.md); each off switch exists for the benchmark that measures what it buys."""

    # Batch-1 products through the Triton GEMV, with the norms, SiLU-and-mul and residual adds
    # folded in (kernels/triton_gemv.py); False: cuBLAS and the separate elementwise kernels.
    triton_gemv: bool = True
    # Products of 2 to 64 rows through the Triton skinny GEMM where it measured at least as fast as
    # cuBLAS (kernels/triton_skinny.py); tensor parallelism keeps its own. 8B decode
    # step on the H200: batch 8 4.951 -> 4.840 ms, batch 32 5.505 -> 5.311 ms.
    skinny_gemm: bool = True
    # A small model's projections (weights under 16M values: SmolLM2-135M, Qwen3-0.6B, the
    # Llama-3.2-1B shape's q/k/v and o) take the skinny GEMM from 2 to 32 rows too, in 16-row tiles
    # where the weight has at most 2,048 outputs; False: cuBLAS, which launches without PDL. Decode
    # step on the H100 at batch 8 / 32: SmolLM2-135M 953 -> 691 / 1,083 -> 791 µs, Qwen3-0.6B shape
    # 1,432 -> 1,195 / 2,020 -> 1,773 µs (bench/engine_small.py --batch 8 --variants
    # default,noskinnysmall).
    skinny_small_weights: bool = True
    # Products of 2 to 128 rows on fp8 weights quantize their activations to e4m3 (one scale per
    # row, dynamic) and multiply on the fp8 tensor cores (W8A8, engine/quantization.py), as
    # vLLM's fp8 does on Hopper; False: W8A16, each weight chunk widened to 16 bits in registers.
    # 8B decode step on the H200, batch 8: 5.551 ms W8A16, 3.451 ms W8A8 (bf16 4.762); on the
    # trained SmolLM2 it costs 3 points of agreement (docs/benchmarks.md, "fp8 weights").
    fp8_activations: bool = True
    pdl: bool = True  # programmatic dependent launch where the GPU has it (Hopper+): kernels/pdl.py
    decode_qkv: bool = True  # batch-1 decode attention also rotates q/k and stores the new k/v
    # ... and so does a decode step of up to this many rows (decode_qkv on): the rotary/KV-store
    # kernel's launch off each layer. 8B decode step on the H100 (2026-12-06, three loads): batch
    # 8 / 32 0.6-1.0 % faster at 32 rows; at 128 rows batch 128 3 % slower, and nano-vllm's
    # workload (~200 rows a step) 2.5 % slower, level at 32.
    decode_qkv_rows: int = 32
    # decode attention reads tiles through the TMA where it applies (Hopper+)
    decode_tma: bool = True
    # Decode attention and its merge launched with PDL too (kernels/pdl.py): each starts while the
    # kernel before it drains. Batch-1 step on the H200: SmolLM2-135M 612 -> 545 µs, Llama-3-8B
    # 4.033 -> 4.001 ms.
    attention_pdl: bool = True
    # The kernels between the products of a step of several tokens (RMSNorm with the residual add,
    # SiLU-and-mul, rotary with the KV store) launched with PDL too, so that no kernel of a
    # multi-row decode layer waits for its predecessor to drain before it launches. 8B decode step
    # on the H200: batch 8 4.766 -> 4.621 ms, batch 32 5.191 -> 4.984 ms.
    elementwise_pdl: bool = True
    # In the decode graphs, a PDL kernel behind one that started after everything before it had
    # finished (cuBLAS's products, launched without PDL) launches once that kernel's blocks have
    # all started, CUDA's launch-completion port, not once they have exited: its launch and
    # ramp-up leave the critical path, its own PDL wait still holds it before what that kernel
    # writes (flashstack/cuda/graph_edges.py). nano-vllm's workload on the H100: 7.14 -> 7.06 s;
    # the 8B step at batch 8 / 32 / 128 level (docs/benchmarks.md, "Throughput").
    pdl_on_launch_completion: bool = True
    # Decode attention over more than one wave of programs starts the longest contexts first, so
    # the shortest fill the last wave (a batch of mixed lengths). nano-vllm's throughput workload
    # on the H200 (Qwen3-0.6B shape, two runs each, interleaved): 6.11 / 6.12 -> 5.97 / 6.04 s.
    decode_longest_first: bool = True
    # Decode launches of 128 or more (sequence, KV head) pairs over a 16-bit cache read 64-token
    # tiles three stages deep through the TMA (kernels/triton_attention.deep_tma_launch): one layer
    # over 208 mixed-length sequences on the H200 231 -> 217 µs; 64-128 sequences all of one
    # length 3-7 % slower.
    decode_deep_tma: bool = True
    # Decode launches of up to one (sequence, KV head) pair per SM over a 16-bit cache, for grids
    # of up to 8,192 tokens, read three stages deep, one program per SM
    # (kernels/triton_attention.tma_launch): the 8B's batch 8 at context 544, one layer on the
    # H200, 12.3 -> 8.8 µs; its decode step 4.577 -> 4.448 ms.
    decode_wave_tma: bool = True
    # Splits of each sequence's context in a decode launch; 0: as many as fill the GPU
    # (triton_attention.plan_decode). One split needs no merge kernel, yet its few programs walk
    # the whole context: the small models' batch-1 step on the H100, SmolLM2-135M 495 -> 852 µs
    # at one split, 649 µs at two (bench/engine_small.py --variants default,splits1,splits2).
    decode_splits: int = 0
    # Decode attention's V tiles (TMA) go to P @ V as fetched: rows past the context are not
    # zeroed (their weights are exactly 0; the engine's cache is zeroed at allocation and a
    # bfloat16 store is finite, so no NaN is there to meet them). Zeroing them took each tile
    # through registers (a select a pair of values) and back to shared memory: compiled for
    # sm_90, the bf16 tile loop drops from 842 to 470 instructions. Taken for bfloat16 tiles
    # outside the deep launch (triton_attention.unmasked_v_applies: a float16 cache can hold an
    # inf). Batch-1 step on the H100: Qwen3-0.6B shape 926.5 -> 898.6 µs, SmolLM2-135M 494 ->
    # 485 µs, the 8B 5.213 -> 5.149 ms (bench/engine_small.py --variants default,maskedv;
    # docs/benchmarks.md). (Each sequence's last split merging the splits, in place of the merge
    # kernel, was slower: SmolLM2 494 -> 524 µs; removed.)
    decode_unmasked_v: bool = True
    # A decode split past its sequence's context returns first thing, before the PDL wait,
    # instead of waiting, rotating q and running an empty loop. A graph's grid holds the splits
    # of the longest context its bound allows: at batch 1 and context 576, 7 of 16 splits a KV
    # head idle. Batch-1 step on the H100: SmolLM2-135M 487 -> 478 µs, Qwen3-0.6B shape 901 ->
    # 897 µs, the 8B level (bench/engine_small.py --variants default,noidleexit; docs/
    # benchmarks.md).
    decode_idle_exit: bool = True
    # A skinny product split along K whose output only feeds the next RMSNorm (the 8B's down
    # projection at 2 to 64 rows: two slices) leaves its float32 slices to that norm, which adds
    # them as the reducing kernel would (kernels/triton_skinny.SplitK): one kernel a layer fewer,
    # the same numbers bit for bit. The 8B's graph replay on the H100: batch 8 5.627 -> 5.589 ms,
    # batch 32 6.104 -> 6.056 ms (bench/engine_decode.py --gemv triton,noslices).
    split_k_in_norm: bool = True
    # A skinny gate/up product (2 to 64 rows, one K slice) returns silu(gate) * up: each program
    # streams the gate and the up rows of the same columns and takes the activation in its
    # epilogue, rounded as the two kernels round it, so no SiLU-and-mul kernel runs before down.
    # 8B decode step on the H100: batch 8 5.636 -> 5.587 ms, batch 32 6.330 -> 6.250 ms (bench/
    # engine_decode.py --gemv triton,noswiglu). Taking it in down's prologue instead, chunk by
    # chunk, was slower (5.639 -> 5.692 ms, 6.335 -> 6.488 ms): each chunk went from registers to
    # shared memory inside the weight stream's loop.
    gate_up_swiglu: bool = True
    # Decode graphs take the logits' argmax inside the graph: a step whose rows are all greedy
    # launches nothing between replays but the tokens' copy back. Batch-1 step on the H200:
    # SmolLM2-135M 544 -> 539 µs; level at the 8B's batch 8 / 32 and on sampled workloads.
    argmax_in_graph: bool = True
    # Decode attention over an fp8 cache multiplies q by K's tiles as stored, on the fp8 tensor
    # cores (q quantized to e4m3, one scale a program; its 64 rows padded for them), where today
    # every tile is converted to fp16 first, which bounds the kernel (docs/benchmarks.md, "fp8 KV
    # cache"). Slower on the H100: the 8B's layer at 32K 32.9 -> 60.6 µs at batch 1 (the padded
    # 64-row product); agreement on the trained model not measured.
    decode_fp8_qk: bool = False
    # Decode attention over an fp8 cache reads its TMA tiles as 16-bit words, two values a word,
    # and splits them into the even and the odd columns in registers (one byte permute and one
    # conversion a pair of values; q's columns split the same way, the output's interleaved once),
    # V's tiles as fetched, two stages (three from a (sequence, KV head) pair per SM): the
    # byte-wide tiles went through shared memory a byte at a time (compiled for sm_90, the tile
    # loop 1,054 -> 553 instructions). One layer of the 8B on the H100: batch 1 at 32K 31.5 ->
    # 29.3 µs, batch 4 at 32K 101.3 -> 94.8 µs, batch 32 at 4K 94.6 -> 91.3 µs
    # (bench/engine_attention.py --fp8; docs/benchmarks.md, "fp8 KV cache").
    decode_fp8_pairs: bool = True
    # Decode attention of up to this many sequences over a 16-bit cache fetches each split's first
    # K and V tiles (TMA) before its PDL wait where the kernel takes the new token's k/v from
    # registers (decode_qkv_rows): old tokens' rows, which nothing in the step writes, arrive
    # while the kernel before drains; 0: none. Batch-1 step on the H100: Llama-3.2-1B shape
    # 1,051 -> 1,034 µs, Qwen3-0.6B shape 893 -> 884 µs, SmolLM2-135M level (bench/
    # engine_small.py --variants default,nopreload); the 8B's batch 8 / 32 with 32 level to 0.3 %
    # slower (bench/engine_decode.py --gemv triton,preload32).
    decode_preload_rows: int = 1
    # Decode attention's grid puts the KV heads first, (kv_heads, batch, splits), not the
    # sequences: programs start in grid order, and a cache row holds every KV head's values of a
    # token, so one sequence's heads starting together read whole rows between them, where one
    # head's programs over many sequences each read a slice of every row. It matters where the
    # programs take several waves. One layer on the H100, sequences first -> heads first: the
    # 8B's heads over 128 mixed contexts 185 -> 173 µs, nano-vllm's 208 mixed 316 -> 311 µs, the
    # 8B at batch 128 103.7 -> 102.3 µs, one wave (batch 32) level; the 8B's batch-128 step 9.19
    # -> 9.16 ms, nano-vllm's workload level (docs/benchmarks.md, "Decode attention launch").
    decode_heads_first: bool = True
    # Decode graphs draw the tokens themselves where every row is greedy or sampled at a
    # temperature alone (no top-k/p, min-p or seed): the inverse-CDF sampler (kernels/
    # triton_sampling.py) reads the temperatures and the seed from the step's staged inputs, in
    # place of the argmax, so a sampled step too launches nothing between replays. Level on
    # nano-vllm's workload on the H100 (7.31 -> 7.28 s, within two runs' spread), so off.
    sample_in_graph: bool = False
    # A decode graph's first kernel reads the step's packed inputs from a ring of pinned host
    # slots, and the previous step's tokens from where the graph before wrote them; the graph's
    # sampler writes the tokens into the ring for the host (engine/input_ring.py, kernels/
    # triton_step_inputs.py). Otherwise a copy from the host, a copy of the tokens into the
    # inputs and a copy back run on the stream between two replays (~11, ~5 and ~5 µs of device
    # time a step on the H100, bench/engine_step_ops.py), and the host queues them. One GPU only:
    # a tensor-parallel group's ranks take rank 0's inputs. Decode step on the H100, off -> on:
    # SmolLM2-135M 471 -> 444 µs, Qwen3-0.6B shape 882 -> 875 µs, the 8B at batch 1 / 8 / 32
    # 5.120 / 5.603 / 6.283 -> 5.109 / 5.582 / 6.268 ms (docs/benchmarks.md, "Decode step").
    graph_fetches_inputs: bool = True
    # A batch-1 step's decoder layers as one persistent kernel (kernels/triton_decoder.py): no
    # kernel boundary inside the stack, each stage's weights streaming while the stage before
    # finishes. For the small models, whose layers cost six kernels' fixed latency each; slower
    # on the GPU so far (SmolLM2-135M on the H100 495 -> 672 µs a step: each stage waits one
    # item's latency; bench/engine_small.py --variants default,persistent), so off.
    persistent_decoder: bool = False
    # Its programs per SM (one: items taken round-robin; more: from an atomic counter) and warps.
    persistent_decoder_programs_per_sm: int = 1
    persistent_decoder_warps: int = 4
    # Its residual stream in tagged words (each value with its step's flag, read once there, as
    # NCCL's low-latency protocol): the q/k/v and gate/up items read it without waiting for a
    # count, and the o and down items release none. Off: counts after every stage. Both give
    # transformers' tokens on the GPU; tagged words measured slower (SmolLM2-135M on the H100:
    # 930.8 against 671.6 µs a step; docs/benchmarks.md).
    persistent_decoder_tagged: bool = False
    # A batch-1 step's MLP as one kernel, gate/up, SiLU-and-mul and down (kernels/triton_mlp.py):
    # five kernels a layer, not six. The down product's partial sums meet in a float32 row by
    # atomics, which the next readers of the residual stream add in; their order is the
    # hardware's, so the last bit of a step can differ run to run. 16- and 32-bit MLP weights,
    # hidden sizes up to 1,024, one GPU. Slower on the H100 so far (SmolLM2-135M 443 -> 506 µs,
    # Qwen3-0.6B shape 874 -> 897 µs a step; docs/benchmarks.md), so off.
    fused_mlp: bool = False
    # A batch-1 step's fp8 down projection takes silu(gate) * up from a SiLU-and-mul kernel of its
    # own, in float16 pre-scaled, instead of computing and converting it in every GEMV program:
    # the fp8 GEMV is bound by conversions (kernels/triton_gemv.py). 8B batch-1 step on the H200:
    # 2.715 -> 2.667 ms.
    fp8_silu_kernel: bool = True
    # A batch-1 GEMV whose weight is at most this many bytes asks the L2 for all of it before its
    # PDL wait, one bulk prefetch a program (kernels/triton_gemv.l2_prefetch_plan); 0: none.
    # Batch-1 step on the H100: SmolLM2-135M (every weight 3.4 MiB or less) 481 -> 467 µs; the
    # Qwen3-0.6B shape's 4 MiB o projection slower (895 -> 909 µs), as were larger weights
    # (Llama-3.2-1B shape 1051 -> 1085 µs at 16 MiB, the 8B's fp8 q/k/v and o 3.25 -> 3.45 ms);
    # bench/engine_small.py --variants default,nol2pf,l2pf4,l2pf16; docs/benchmarks.md.
    gemv_l2_prefetch_bytes: int = 7 << 19  # 3.5 MiB
    # Tensor-parallel all-reduces and gathers of decode steps: "push" over NVLink peer memory
    # (kernels/triton_collectives.py, GPUs only), or "nccl" for everything.
    tp_all_reduce: str = "push"
    tp_all_reduce_block: int = 2048  # values per program of the push kernels
    tp_all_reduce_warps: int = 4
    # bound on start-up and device collectives of a TP group
    tp_timeout_s: float = DEFAULT_TP_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.tp_all_reduce not in TP_ALL_REDUCES:
            raise ValueError(
                f"kernels.tp_all_reduce must be one of {TP_ALL_REDUCES}, got {self.tp_all_reduce!r}"
            )
        block = self.tp_all_reduce_block
        if block < 64 or block & (block - 1):
            raise ValueError(
                f"kernels.tp_all_reduce_block must be a power of two >= 64, got {block}"
            )
        if self.tp_all_reduce_warps not in (1, 2, 4, 8, 16):
            raise ValueError(
                "kernels.tp_all_reduce_warps must be 1, 2, 4, 8 or 16, got "
                f"{self.tp_all_reduce_warps}"
            )
        if self.decode_splits < 0:
            raise ValueError(
                f"kernels.decode_splits must be 0 (as many as fill the GPU) or more, got "
                f"{self.decode_splits}"
            )
        if self.gemv_l2_prefetch_bytes < 0:
            raise ValueError(
                "kernels.gemv_l2_prefetch_bytes must be 0 (no prefetch) or more, got "
                f"{self.gemv_l2_prefetch_bytes}"
            )
        if self.decode_preload_rows < 0:
            raise ValueError(
                "kernels.decode_preload_rows must be 0 (no launch preloads) or more, got "
                f"{self.decode_preload_rows}"
            )
        if self.decode_qkv_rows < 1:
            raise ValueError(
                f"kernels.decode_qkv_rows must be at least 1, got {self.decode_qkv_rows}"
            )
        if self.persistent_decoder_programs_per_sm < 1:
            raise ValueError(
                "kernels.persistent_decoder_programs_per_sm must be at least 1, got "
                f"{self.persistent_decoder_programs_per_sm}"
            )
        if self.persistent_decoder_warps not in (1, 2, 4, 8, 16):
            raise ValueError(
                "kernels.persistent_decoder_warps must be 1, 2, 4, 8 or 16, got "
                f"{self.persistent_decoder_warps}"
            )
        if self.tp_timeout_s <= 0:
            raise ValueError(f"kernels.tp_timeout_s must be positive, got {self.tp_timeout_s}")

    @classmethod
    def of(cls, value: KernelOptions | dict[str, Any] | None) -> KernelOptions:
        """Options from a config file's mapping (unknown keys named), or as given."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown kernels option(s) {unknown}; known: {sorted(known)}")
        return cls(**value)

    def resolved(self, device: torch.device) -> KernelOptions:
        """These options as they apply on `device`: the GPU kernels off elsewhere, the Hopper
        features (PDL, TMA) off before compute capability 9.0."""
        if device.type != "cuda":
            return replace(
                self,
                triton_gemv=False,
                skinny_gemm=False,
                pdl=False,
                decode_qkv=False,
                decode_tma=False,
                attention_pdl=False,
                elementwise_pdl=False,
                decode_longest_first=False,
                decode_deep_tma=False,
                decode_wave_tma=False,
                persistent_decoder=False,
                fused_mlp=False,
            )
        from flashstack.cuda.torch_interop import device_for

        hopper = device_for(device).compute_capability >= (9, 0)
        return replace(
            self,
            pdl=self.pdl and hopper,
            decode_tma=self.decode_tma and hopper,
            attention_pdl=self.attention_pdl and hopper,
            elementwise_pdl=self.elementwise_pdl and hopper,
        )

    def describe(self) -> str:
        """One line for the start-up log."""
        return " ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))


@dataclass(slots=True)
class EngineConfig:
    """Everything the engine needs to run one model; filled in further by `LLM` after loading."""

    model: str
    block_size: int = 256
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # Prompt tokens a step that also decodes running streams may take while the queued prompts fit
    # in one step (a deeper queue, a burst, gets max_num_batched_tokens): it bounds how long a new
    # prompt stalls the streams (their inter-token tail) at a few steps of its own first token.
    # 0: off.
    decode_step_prefill_tokens: int = 1024
    # While the waiting prompts are more than one step's max_num_batched_tokens (a burst), up to
    # this many steps in a row take prompts only and the running streams sit them out, as SGLang
    # and vLLM v0 schedule: each stream then gets one longer gap instead of a long step per token,
    # and the burst's first tokens come sooner. 0: decodes run in every step.
    burst_prefill_steps: int = 16
    max_model_len: int | None = None
    dtype: str = "auto"
    device: str = "auto"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"  # "fcfs" or "priority" (lower value is served first)
    num_kv_blocks: int | None = (
        None  # None: sized from memory (see kv_cache_memory_gb, gpu_memory_utilization)
    )
    kv_cache_memory_gb: float | None = None  # CPU: KV budget; None means 1 GiB
    gpu_memory_utilization: float = 0.9
    attention_backend: str = (
        "auto"  # "auto", "reference", or a name registered in kernels.attention
    )
    # True: no CUDA graphs (debugging, or to save capture time)
    enforce_eager: bool = False
    # Steps with prefill chunks of up to this many tokens (and max_num_batched_tokens) replay CUDA
    # graphs (engine/mixed_graphs.py), one GPU only; 0: they run eagerly.
    mixed_step_graph_tokens: int = 2048
    # Queue each decode step's successor before reading the step's tokens back, so the device
    # never idles while the host schedules and streams (vLLM's async scheduling). False: one step
    # at a time.
    async_scheduling: bool = True
    # With async_scheduling, a burst's next step of prompts is queued too while the one before it
    # runs (none of its inputs is a token still being sampled), so the device does not wait for
    # the host to schedule and pack 8K-token steps between them; so is the step after its last,
    # where the streams that sat the burst out decode the host's tokens beside the prompts it
    # completes. False: a burst's steps run one at a time.
    burst_lookahead: bool = True
    show_progress: bool = True
    seed: int = 0
    tensor_parallel_size: int = 1  # ranks (GPUs, or CPU processes over gloo) sharing one model
    # Preemption when KV blocks run out: "swap" the victim's blocks to host memory, "recompute" its
    # prefill later, or "auto": whichever engine/swap.py's cost estimate says is cheaper.
    preemption_mode: str = "auto"
    swap_space_gb: float = 4.0  # host memory for swapped-out KV blocks (pinned on CUDA)
    # The estimate's constants; None takes engine/swap.py's DEVICE_DEFAULTS for the device type.
    swap_bandwidth_gbps: float | None = None  # host<->device copy rate, GB/s
    recompute_tflops: float | None = None  # achieved prefill rate, TFLOP/s
    # "fp8": the decoder's linear weights quantized at load to float8_e4m3fn with one scale per
    # output row (as vLLM's --quantization fp8); embeddings, lm_head and norms keep `dtype`. An fp8
    # checkpoint (compressed-tensors) is fp8 whatever this says. "q8_0": llama.cpp's Q8_0 (int8
    # with a float16 scale per 32 weights), a GGUF file's Q8_0 tensors kept as stored, the rest
    # quantized at load (engine/quantization.py): on the H200 faster than bf16 at batch 1 only
    # (8B: 3.64 vs 4.03 ms), slower from 8 rows (6.82 vs 4.76 ms; docs/benchmarks.md, "Q8_0").
    # "q4_k": llama.cpp's Q4_K (4.5 bits a weight), a GGUF file's Q4_K tensors kept as stored, the
    # rest quantized at load; projections whose rows are not whole 256-weight super-blocks take
    # q8_0 (said in the log at load).
    quantization: str | None = None
    # "fp8": the KV cache in float8_e4m3fn (half the bytes of bf16) with one K and one V scale per
    # layer, calibrated at start-up (engine/kv_cache.py); "auto": the model's dtype.
    kv_cache_dtype: str = "auto"
    kernels: KernelOptions = field(default_factory=KernelOptions)
    hf_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.kernels = KernelOptions.of(self.kernels)
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.burst_prefill_steps < 0:
            raise ValueError(
                "burst_prefill_steps must be >= 0 (0: decodes run in every step), "
                f"got {self.burst_prefill_steps}"
            )
        if self.decode_step_prefill_tokens < 0:
            raise ValueError(
                "decode_step_prefill_tokens must be >= 0 (0: no cap beside decodes), "
                f"got {self.decode_step_prefill_tokens}"
            )
        if self.mixed_step_graph_tokens < 0:
            raise ValueError(
                "mixed_step_graph_tokens must be >= 0 (0: mixed steps run eagerly), "
                f"got {self.mixed_step_graph_tokens}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                "quantization must be None (the checkpoint's weights), 'fp8', 'q8_0' or 'q4_k', "
                f"got {self.quantization!r}"
            )
        if self.quantization and self.tensor_parallel_size > 1:
            raise ValueError(
                f"quantization={self.quantization!r} runs on one device: set "
                "tensor_parallel_size=1 or leave quantization unset"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.kv_cache_dtype == "fp8" and self.tensor_parallel_size > 1:
            raise ValueError(
                "kv_cache_dtype='fp8' runs on one device for now: set tensor_parallel_size=1 or "
                "kv_cache_dtype='auto'"
            )
        if self.preemption_mode not in ("auto", "swap", "recompute"):
            raise ValueError(
                "preemption_mode must be 'auto', 'swap' or 'recompute', "
                f"got {self.preemption_mode!r}"
            )
        if self.swap_space_gb < 0:
            raise ValueError(f"swap_space_gb must be >= 0, got {self.swap_space_gb}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}"
            )
