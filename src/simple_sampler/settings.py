"""Every setting of the served models, declared once.

A settings class is a dataclass whose fields are made by :func:`setting`:
type and default (the field's), allowed values (``choices`` or
``minimum``), one line of help. From it come

* the options of ``simple-sampler serve`` (:meth:`Settings.add_arguments`,
  :meth:`Settings.from_arguments`);
* the values of the ``${name}`` placeholders of the model's config.pbtxt
  template (:meth:`Settings.template_values`; the template itself stays
  hand-written so that ``simple-sampler fill-template`` keeps working, and
  tests/test_settings.py holds its ``parameters`` entries to the fields);
* the checks, in the launcher (:meth:`Settings.validate`) and in the model,
  which reads its config.pbtxt ``parameters`` back
  (:meth:`Settings.from_parameters`).

Adding a setting is adding one field (plus, for a ``parameter``, its entry in
the template). This module imports nothing heavy: the CLI parser and the
decoder's defaults read it.

"max batch size" has three meanings here, so none of ours is called just
that: ``generate_max_batch_size`` (Triton's ``max_batch_size`` of the
ensemble, preprocessing and llm models), ``engine_max_batch_size`` (sequences
the data plane decodes together) and ``sampler_max_batch_size`` (Triton's
``max_batch_size`` of the simple_sampler model: rows per sampler request).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

from .addresses import PORT_RANGE, check_distinct_ports, parse_endpoints

#: SmolLM2's vocabulary: the default model's, its shipped hot-vocab profile's
#: and its real rows' (rows.py).
SMOLLM2_VOCAB = 49_152
#: How the llm model samples (serving/decoder.py).
SAMPLING_MODES = ("simple", "inline", "inline_kernels")
#: The whole-server benches' modes (bench serve, perf) -> (sampling mode,
#: micro-batches): simple_overlap is no sampling mode of its own but simple
#: with the batch split in two, so that sampling one half overlaps the other's forward.
SERVED_MODES = {"simple": ("simple", 1), "simple_overlap": ("simple", 2),
                "inline": ("inline", 1), "inline_kernels": ("inline_kernels", 1)}
#: The data planes' names; serving/engines.py is their registry (a test
#: holds the two equal: this module imports nothing of serving/).
ENGINE_NAMES = ("torch", "static", "tensorrt_llm", "simulated")
#: How the decode loop hands rows to the sampler (docs/HANDOFF.md).
HANDOFFS = ("full", "hot-first")
ROW_TRANSPORTS = ("arena", "bls")
#: What a token's logprobs are (``LlmSettings.logprobs_mode``).
LOGPROBS_MODES = ("adjusted_logprobs", "raw_logprobs")
#: Where the torch and static engines run (serving/device.py).
TORCH_DEVICES = ("cpu", "cuda")
#: The torch and static engines' model dtypes -> the sampler's name for
#: their logits, which come in the model's dtype (serving/torch_engine.py).
#: ``LlmSettings.launch_ahead``'s values
LAUNCH_AHEAD = ("auto", "on", "off")
TORCH_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
#: Logits dtypes the sampler can be configured for -> bytes per logit.
LOGITS_ITEMSIZE = {"fp32": 4, "fp16": 2, "bf16": 2}
#: The static engine's decode steps (bench serve-gpu --decode-step): as
#: written, or compiled (its compile_decode).
DECODE_STEPS = ("eager", "compiled")
#: The simulated engine's logits dtypes -> the sampler's name for them.
SIMULATED_DTYPES = {name: TORCH_DTYPES[name] for name in ("float32", "bfloat16")}
#: The words every output of a run on the simulated engine starts with.
SIMULATED_LABEL = "simulated data plane"


#: The most generations one request to the generation models may ask for: its
#: prompts (generate_max_batch_size) times each one's sequences
#: (num_return_sequences; the OpenAI door's n).
MAX_GENERATIONS = 256


def setting(default: Any, help: str, *, choices=(), minimum=None, maximum=None,
            flag: str | None = "",
            aliases: tuple[str, ...] = (), parameter: bool = True,
            engines: tuple[str, ...] = (), required_by: tuple[str, ...] = ()):
    """One settings field.

    default: the value and, by its type, how text is parsed (bool: true/false).
    help: one line for ``serve --help`` and the docs.
    choices / minimum / maximum: the allowed values (checked by ``validate``;
        a float must be finite too).
    flag: ``serve``'s option; "" derives ``--name-with-dashes``, None: none.
    aliases: older names still accepted, as option strings (``--x``) or
        config.pbtxt parameter keys (bare names).
    parameter: True when the model reads it from its config.pbtxt
        ``parameters``; False when it fills a field of Triton's own (an
        instance count, ``max_batch_size``, a data type).
    engines: the engines it applies to (others must leave it at its default);
        () for all.
    required_by: the engines that need it set (not empty).
    """
    return field(default=default, metadata={
        "help": help, "choices": tuple(choices), "minimum": minimum, "maximum": maximum,
        "flag": flag,
        "aliases": tuple(aliases), "parameter": parameter, "engines": tuple(engines),
        "required_by": tuple(required_by)})


def _parse(name: str, default: Any, text: str):
    """A config.pbtxt string as the type of the field's default (bool("false") is True)."""
    if isinstance(default, bool):
        if text.lower() not in ("true", "false"):
            raise ValueError(f"{name} must be true or false, got {text!r}")
        return text.lower() == "true"
    try:
        return type(default)(text)
    except ValueError:
        raise ValueError(f"{name} must be {type(default).__name__}, got {text!r}") from None


def allowed_range(f: dataclasses.Field) -> str:
    """A numeric field's range as messages and docs/CONFIGURATION.md say it
    (">= 1", "in [0, 65535]"); "" without one."""
    minimum, maximum = f.metadata["minimum"], f.metadata["maximum"]
    if maximum is None:
        return "" if minimum is None else f">= {minimum}"
    return f"in [{minimum}, {maximum}]" if minimum is not None else f"<= {maximum}"


def _text(value: Any) -> str:
    """A value as config.pbtxt writes it (booleans in lower case)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


class Settings:
    """What the settings dataclasses share (module docstring)."""

    #: The model whose config.pbtxt the settings fill, for messages.
    triton_model: ClassVar[str] = ""

    @classmethod
    def settings_fields(cls) -> tuple[dataclasses.Field, ...]:
        return dataclasses.fields(cls)

    def validate(self) -> "Settings":
        """Raise ValueError naming the first setting out of its range; returns self."""
        for f in self.settings_fields():
            value, choices = getattr(self, f.name), f.metadata["choices"]
            if choices and value not in choices:
                raise ValueError(f"{f.name} must be one of {', '.join(map(str, choices))}, "
                                 f"got {value!r}")
            allowed = allowed_range(f)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{f.name} must be a finite number{f' {allowed}' * bool(allowed)}"
                                 f", got {value}")
            minimum, maximum = f.metadata["minimum"], f.metadata["maximum"]
            if (minimum is not None and value < minimum) or (maximum is not None
                                                             and value > maximum):
                raise ValueError(f"{f.name} must be {allowed}, got {value}")
        self.check()
        return self

    def check(self) -> None:
        """Rules across settings (subclasses); ranges are validate()'s."""

    @classmethod
    def from_parameters(cls, parameters: Mapping[str, str]):
        """The settings a model reads from its config.pbtxt ``parameters``
        (name -> string value), validated; absent ones keep their default."""
        own = [f for f in cls.settings_fields() if f.metadata["parameter"]]
        known = {name: f for f in own
                 for name in (f.name, *(a for a in f.metadata["aliases"] if a[0] != "-"))}
        unknown = sorted(set(parameters) - set(known))
        if unknown:
            raise ValueError(f"unknown {cls.triton_model} parameter {unknown[0]}; known: "
                             f"{', '.join(f.name for f in own)}")
        values = {}
        for key, text in parameters.items():
            name = known[key].name
            if name in values:
                raise ValueError(f"{cls.triton_model} parameters set {name} twice (under its "
                                 f"name and an older key): keep one")
            values[name] = _parse(name, known[key].default, text)
        return cls(**values).validate()

    def parameters(self) -> dict[str, str]:
        """The config.pbtxt ``parameters`` (name -> string value)."""
        return {f.name: _text(getattr(self, f.name)) for f in self.settings_fields()
                if f.metadata["parameter"]}

    def template_values(self) -> dict[str, str]:
        """Every field as the text its ``${name}`` placeholder gets."""
        return {f.name: _text(getattr(self, f.name)) for f in self.settings_fields()}

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """One option per field with a flag. Options default to None (not
        given), so the dataclass stays the only place defaults are written."""
        for f in cls.settings_fields():
            if f.metadata["flag"] is None:
                continue
            flags = [f.metadata["flag"] or "--" + f.name.replace("_", "-"),
                     *(a for a in f.metadata["aliases"] if a[0] == "-")]
            help = f"{f.metadata['help']} (default: {_text(f.default) or repr('')})"
            if isinstance(f.default, bool):
                # on by default: --name and --no-name, so either can be said
                parser.add_argument(*flags, dest=f.name, default=None, help=help,
                                    action=argparse.BooleanOptionalAction if f.default
                                    else "store_true")
            else:
                parser.add_argument(*flags, dest=f.name, type=type(f.default), default=None,
                                    choices=f.metadata["choices"] or None, help=help)

    @classmethod
    def given_flags(cls, args: argparse.Namespace) -> list[str]:
        """The options of these settings given on the command line, as given
        (--no-x: a setting on by default, turned off)."""
        return [("--no-" if getattr(args, f.name) is False and f.default is True else "--")
                + (f.metadata["flag"] or "--" + f.name.replace("_", "-"))[2:]
                for f in cls.settings_fields()
                if f.metadata["flag"] is not None and getattr(args, f.name, None) is not None]

    @classmethod
    def from_arguments(cls, args: argparse.Namespace, **values):
        """The settings of the options given (others keep their defaults);
        `values` set fields the options do not carry."""
        given = {f.name: getattr(args, f.name) for f in cls.settings_fields()
                 if f.metadata["flag"] is not None and getattr(args, f.name, None) is not None}
        return cls(**{**given, **values})


@dataclass
class SamplerSettings(Settings):
    """The simple_sampler model (model_repository/simple_sampler/config.pbtxt)."""

    triton_model: ClassVar[str] = "simple_sampler"

    sampler_instances: int = setting(2, "simple_sampler CPU instances (processes)", minimum=1,
                                     flag="--instances", parameter=False)
    sampler_max_batch_size: int = setting(
        256, "rows per sampler request: Triton's max_batch_size of simple_sampler; sizes its "
        "shared memory", minimum=1, aliases=("--max-batch-size",), parameter=False)
    max_queue_delay_us: int = setting(0, "dynamic batching delay of the sampler", minimum=0,
                                      parameter=False)
    logits_dtype: str = setting("fp32", "data type of the logits input",
                                choices=tuple(LOGITS_ITEMSIZE), parameter=False)
    num_threads: int = setting(1, "kernel threads per instance", minimum=1)
    vocab_size: int = setting(0, "refuse logits of another width (0: accept any)", minimum=0)
    hot_vocab_profile: str = setting(
        "", "speculative hot-vocab sampling profile from `simple-sampler calibrate` (relative "
        "to the model's directory; \"\": SHVS off)", flag=None)

    def template_values(self) -> dict[str, str]:
        return {**super().template_values(),
                "logits_dtype": f"TYPE_{self.logits_dtype.upper()}"}

    def request_bytes(self, vocab_hint: int = 152_064) -> int:
        """Shared memory one full request needs: sampler_max_batch_size rows
        of logits (vocab_size, or `vocab_hint` when any vocabulary is accepted)."""
        vocab = self.vocab_size or vocab_hint
        return self.sampler_max_batch_size * vocab * LOGITS_ITEMSIZE[self.logits_dtype]


@dataclass
class LlmSettings(Settings):
    """The generation models: the llm model's parameters
    (model_repository/llm/config.pbtxt) and the Triton fields of the
    ensemble, preprocessing, postprocessing and llm configs."""

    triton_model: ClassVar[str] = "llm"

    model: str = setting(
        "", "Hugging Face directory or GGUF file (\"\": SmolLM2-135M-Instruct); a checkpoint "
        "or engine directory for tensorrt_llm", required_by=("tensorrt_llm",))
    engine: str = setting("torch", "data plane: PyTorch on the CPU or a CUDA GPU (device), "
                          "static (PyTorch with a static KV cache, the decode step replayed as "
                          "CUDA graphs on cuda, eager on cpu), TensorRT-LLM on GPUs "
                          "(docs/GPU.md), or simulated: no model, GPU-paced sleeps and synthetic "
                          "rows, for benchmarks (docs/SIMULATED.md)", choices=ENGINE_NAMES)
    device: str = setting(
        "cpu", "torch and static engines: where the model runs (cuda: the current GPU; logits "
        "cross to the sampler by one device-to-host copy per step, into a page-locked slot of "
        "the row arena when it serves them, else into pinned memory; inline sampling stays on "
        "the GPU)",
        choices=TORCH_DEVICES, engines=("torch", "static"))
    torch_dtype: str = setting(
        "float32", "torch and static engines: the model's dtype, and its logits' (the sampler's "
        "logits_dtype follows it; bfloat16 and float16 on cuda only)",
        choices=tuple(TORCH_DTYPES), engines=("torch", "static"))
    model_config: str = setting(
        "", "static engine: a shipped shape (smollm2-135m, qwen2.5-0.5b, llama-3.2-1b, "
        "llama-3.1-8b) or a config.json, RANDOM WEIGHTS drawn on the device (its step times, "
        "not its tokens); \"\": --model's weights", engines=("static",))
    compile_decode: bool = setting(
        False, "static engine: the decode step compiled (torch.compile over fused q/k/v and "
        "gate/up weights, serving/compiled_decode.py; NOT yet run on a GPU); its first decode step (and bucket 1's) "
        "compiles first", engines=("static",))
    tensor_parallel_size: int = setting(1, "tensorrt_llm only", minimum=1,
                                        engines=("tensorrt_llm",))
    pipeline_parallel_size: int = setting(1, "tensorrt_llm only", minimum=1,
                                          engines=("tensorrt_llm",))
    sampling_mode: str = setting(
        "simple", "simple: the simple_sampler model samples; inline: PyTorch in the data "
        "plane (the baseline); inline_kernels: our kernels in the data plane",
        choices=SAMPLING_MODES)
    generate_max_batch_size: int = setting(
        64, "Triton's max_batch_size of the ensemble, preprocessing and llm models (the most "
        "prompts a request holds, each its own generation): clients send [B, 1] tensors "
        "(TensorRT-LLM's shapes); 0: [1] in and out, as Triton's vLLM backend's models take "
        "and give them",
        minimum=0, maximum=MAX_GENERATIONS, parameter=False)
    preprocessing_instances: int = setting(1, "tokenizer instances", minimum=1, flag=None,
                                           parameter=False)
    postprocessing_instances: int = setting(
        1, "TensorRT-LLM's postprocessing model's instances (token ids to text, for its "
        "clients that call it)", minimum=1, flag=None, parameter=False)
    # TensorRT-LLM's key; the model reads Triton's field back (from_config)
    decoupled_mode: bool = setting(
        True, "the llm model decoupled (Triton's model_transaction_policy; TensorRT-LLM's "
        "decoupled_mode): true streams, refuses unary infer calls (HTTP generate, gRPC streams "
        "work); false answers a request once, so unary calls work (tritonclient's infer, "
        "perf_analyzer without --streaming), refusing streams and several prompts or sequences",
        parameter=False)
    engine_max_batch_size: int = setting(
        32, "sequences the data plane decodes together; more wait in a queue", minimum=1,
        aliases=("max_batch_size",))
    max_context: int = setting(1024, "tokens per sequence, prompt and generated", minimum=2)
    # 1: on a CPU data plane a second lane re-reads the weights and competes
    # with the sampler for the cores (docs/BENCHMARKS.md, `bench serve`); 2 pays
    # off when the forward runs on a GPU.
    micro_batches: int = setting(
        1, "lanes overlapping the data plane with sampling (1: none; 2 pays off with a GPU "
        "data plane, not on CPU; one with tensorrt_llm, whose in-flight batching schedules its "
        "own steps)", minimum=1)
    launch_ahead: str = setting(
        "auto", "launch a step's forward before the step before it has made its events "
        "(their Python then runs beside the forward; not for requests with stop strings): on, "
        "off, or auto: on where the forward leaves the host's cores free (a GPU, the "
        "simulated engine); never with tensorrt_llm, which schedules its own steps",
        choices=LAUNCH_AHEAD)
    sampler_shards: int = setting(
        2, "concurrent sampler requests per micro-batch (serve: one per local sampler "
        "instance unless given, or given 0)",
        minimum=1)
    # 64: a request's fixed cost (llm stub, tritonserver, a sampler stub: a
    # few hundred us) near a twentieth of 64 full rows' kernel (~75 us each
    # at V = 151,936), and < 128 rows on one instance still hide under the
    # other lane's GPU step (docs/CONFIGURATION.md, below the LlmSettings
    # table). One lane hides nothing: sampler_pool.ONE_LANE_ROWS_PER_REQUEST.
    sampler_shard_min_rows: int = setting(
        64, "full rows per sampler request at least with two micro-batches or more (with one, "
        "at most 8: the step waits for its sampling, so its rows go over every instance): a "
        "micro-batch step of fewer than twice as many goes to one instance, the instances "
        "taken in turn (1: one request per instance whatever the rows)", minimum=1)
    exclude_input_in_output: bool = setting(
        False, "a request that does not say: its non-streamed answer without the prompt "
        "(TensorRT-LLM's tensorrt_llm model's parameter of that name)")
    logprobs_mode: str = setting(
        "adjusted_logprobs", "what a token's logprobs (and its top logprobs) are: "
        "adjusted_logprobs, those of the distribution it is drawn from before min_p, top_k and "
        "top_p (after bias, bans, penalties and temperature); raw_logprobs, the model's own "
        "log_softmax before all of these (a grammar's and allowed_token_ids' masks, applied to "
        "the rows, excepted), vLLM's default --logprobs-mode",
        choices=LOGPROBS_MODES)
    stream_interval: int = setting(
        1, "a stream's tokens per response unless its request sets stream_interval (its "
        "first token goes at once, as vLLM's, SGLang's and TensorRT-LLM's; the last response "
        "may hold fewer): fewer responses cost the server less per token",
        minimum=1)
    # 4: docs/results/send-threads-2026-12-02.md (1.5x the tokens/s of 1 at B = 256, k = 1)
    send_threads: int = setting(
        4, "threads sending a step's responses, the decode loop's own among them (a request's "
        "on one, in order): each send waits, the GIL released, for the server process to take "
        "the response, and several overlap (1: the decode loop alone)", minimum=1, maximum=32)
    sampler_model: str = setting("simple_sampler", "the sampler model called through BLS",
                                 flag=None)
    sampler_endpoints: str = setting(
        "local", "where the decode loop samples: 'local' (this server's instances) and/or "
        "host:port gRPC endpoints of servers started with --sampler-only, comma-separated")
    shutdown_grace_s: float = setting(
        30.0, "on SIGTERM/SIGINT, seconds in-flight requests get to finish before they end "
        "with an error (then Triton stops)", minimum=0.0, flag="--shutdown-grace")
    batch_invariant: bool = setting(
        False, "torch engine on the CPU (device cpu), Llama-architecture models: logits of a "
        "sequence independent of the rest of the batch, so a seed gives the same text at any "
        "concurrency (off by default for its cost: docs/SERVING.md, \"Same seed, same text\")",
        engines=("torch",))
    # The simulated engine (serving/simulated.py, docs/SIMULATED.md): its step
    # time t(B) = a + b * B and rows; the defaults' sources are in its docstring.
    sim_vocab: int = setting(151_936, "engine simulated: vocabulary of its synthetic rows "
                             "(SmolLM2's own, Llama 3, Qwen)", choices=(49_152, 128_256, 151_936),
                             engines=("simulated",))
    sim_dtype: str = setting("bfloat16", "engine simulated: dtype of its logits",
                             choices=tuple(SIMULATED_DTYPES), engines=("simulated",))
    sim_step_a_ms: float = setting(
        9.0, "engine simulated: a of its step time a + b * B, ms (Llama-3-8B, H100, batch 1)",
        minimum=0.0, engines=("simulated",))
    sim_step_b_ms: float = setting(
        0.04, "engine simulated: b of its step time a + b * B, ms per sequence (KV-cache "
        "bytes at a 1,024-token context over H100 bandwidth)", minimum=0.0, engines=("simulated",))

    # full by default: on a CPU engine the summary is torch work in this
    # process (340-540 us/row, docs/HANDOFF.md) against 30-45 us/row for the
    # sampler's whole full path; the torch engine on CUDA runs it next to the
    # logits, measured only in-process with random weights so far
    # (docs/results/gpu-2026-11-27c.md).
    handoff: str = setting(
        "full", "how rows cross to the sampler: full rows, or hot-first (the hot set's "
        "logits, the touched ones and an exact cold summary; the rest whole only when needed: "
        "docs/HANDOFF.md) when the sampler has a hot set (local instances and sampler servers "
        "on other hosts alike)",
        choices=HANDOFFS)
    row_transport: str = setting(
        "arena", "how full rows reach this server's sampler instances: written once into a "
        "shared-memory arena they map (requests carry references), or inside the BLS request "
        "(Triton copies each row three times: docs/COPIES.md); arena falls back to bls when "
        "it cannot be set up", choices=ROW_TRANSPORTS)
    hot_vocab_profile: str = setting(
        "", "the sampler's hot-vocab profile, for the hot-first handoff (serve sets it from "
        "--hot-vocab; relative to the sampler model's directory)", flag=None)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "LlmSettings":
        """The settings of the llm model's configuration (Triton's JSON of its
        config.pbtxt): its parameters, and decoupled_mode from Triton's field."""
        settings = cls.from_parameters({key: value.get("string_value", "") for key, value
                                        in config.get("parameters", {}).items()})
        decoupled = bool(config.get("model_transaction_policy", {}).get("decoupled", False))
        return dataclasses.replace(settings, decoupled_mode=decoupled)

    def check(self) -> None:
        for f in self.settings_fields():
            value = getattr(self, f.name)
            if self.engine in f.metadata["required_by"] and not value:
                raise ValueError(f"engine {self.engine} needs {f.name}: {f.metadata['help']}")
            if f.metadata["engines"] and self.engine not in f.metadata["engines"] \
                    and value != f.default:
                raise ValueError(f"{f.name} applies to engine "
                                 f"{' or '.join(f.metadata['engines'])} only, not {self.engine}")
        if self.batch_invariant and self.device != "cpu":
            raise ValueError(
                "batch_invariant runs on the CPU only (device cpu): its fixed tiles were measured "
                "against the CPU GEMM's row blocking (serving/batch_invariant.py); on CUDA, "
                "cuBLAS and the attention kernels choose their algorithms by shape, which was "
                "never measured")
        if self.sampling_mode != "simple" and self.micro_batches > 1:
            raise ValueError(f"micro_batches applies to sampling_mode simple only: "
                             f"{self.sampling_mode} samples in the data plane, one lane")
        if self.device == "cpu" and self.torch_dtype != "float32":
            raise ValueError(f"torch_dtype {self.torch_dtype} needs device cuda: the engine runs "
                             f"float32 on the CPU")
        parse_endpoints(self.sampler_endpoints)

    def hot_first_unavailable(self) -> str | None:
        """Why handoff hot-first cannot apply and full rows cross instead (no
        sampler profile); None when it applies or was not asked for. Remote
        endpoints take compact rows too: each request names the hot set
        they were made with, and a sampler server holding another refuses
        it (``sampler_serve.check_hot_set``)."""
        if self.handoff != "hot-first":
            return None
        if not self.hot_vocab_profile:
            return ("the sampler has no hot-vocab profile (serve --hot-vocab PROFILE.npz: the "
                    "shipped one is SmolLM2's, `simple-sampler calibrate` makes one)")
        return None


@dataclass
class FrontendSettings(Settings):
    """The OpenAI-compatible front door ``serve`` starts beside Triton
    (src/simple_sampler/frontend/, docs/OPENAI.md); no model reads these."""

    openai_port: int = setting(
        9000, "port of the OpenAI-compatible HTTP API (OpenAI's completions, chat and Responses, "
        "Anthropic's Messages, /v1/models, /metrics: docs/OPENAI.md); 0: off", minimum=0,
        maximum=PORT_RANGE[1], parameter=False)
    openai_host: str = setting("0.0.0.0", "address the OpenAI-compatible API listens on",
                               parameter=False)
    tool_call_parser: str = setting(
        "none", "the OpenAI API's parser of tool calls in free text, which tool_choice auto "
        "needs (vLLM's --tool-call-parser): hermes (<tool_call>{...}</tool_call>, Qwen2.5's "
        "and Hermes' format); none: auto refused", choices=("none", "hermes"), parameter=False)
    generation_config: str = setting(
        "auto", "the OpenAI API's defaults for the sampling fields a request leaves out (vLLM's "
        "--generation-config): auto: the model's generation_config.json's temperature, top_p, "
        "top_k, min_p, repetition_penalty and max_new_tokens (chat's max_tokens), as vLLM; vllm: "
        "none of them", choices=("auto", "vllm"), parameter=False)


@dataclass
class ServerSettings(Settings):
    """Triton's own endpoints, as ``serve`` starts it; no model reads these."""

    http_port: int = setting(8000, "Triton's HTTP/REST port (KServe v2, generate)",
                             minimum=PORT_RANGE[0], maximum=PORT_RANGE[1], parameter=False)
    grpc_port: int = setting(8001, "Triton's gRPC port", minimum=PORT_RANGE[0],
                             maximum=PORT_RANGE[1], parameter=False)
    metrics_port: int = setting(8002, "Triton's Prometheus metrics port", minimum=PORT_RANGE[0],
                                maximum=PORT_RANGE[1], parameter=False)

    def check(self) -> None:
        check_distinct_ports(http_port=self.http_port, grpc_port=self.grpc_port,
                             metrics_port=self.metrics_port)
