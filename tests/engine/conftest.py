"""Tiny random checkpoints and PEFT adapters, and transformers + PEFT as the oracle."""

import json
import os
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import httpx
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from kernels import interpreter
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
VOCAB = 160
ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {
        "rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 32},
        "rope_theta": 50000.0,
    }),
    "mistral": (MistralConfig, MistralForCausalLM, {"tie_word_embeddings": True, "sliding_window": None}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    # head_dim apart from hidden / heads, windows shorter than the test prompts
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 24, "tie_word_embeddings": True}),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, {
        "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8, "attn_logit_softcapping": 4.0,
        "final_logit_softcapping": 6.0,
    }),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, {  # 3 layers: sliding, sliding, full
        "num_hidden_layers": 3, "sliding_window_pattern": 3, "head_dim": 16, "query_pre_attn_scalar": 24,
        "sliding_window": 8, "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
        },
    }),
    "qwen2-yarn": (Qwen2Config, Qwen2ForCausalLM, {  # Qwen2.5's recipe for long contexts
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    }),
    # Phi-4-mini's shape: fused qkv/gate_up in the checkpoint, LongRoPE past 32 tokens, 0.75 of each head
    # rotating (12 of 16 dims: 6 factors), tied embeddings, and a window (Phi-3-mini's, shorter)
    "phi3": (Phi3Config, Phi3ForCausalLM, {
        "original_max_position_embeddings": 32, "partial_rotary_factor": 0.75, "tie_word_embeddings": True,
        "sliding_window": 20, "pad_token_id": 0, "rope_scaling": {
            "rope_type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.0],
            "long_factor": [1.5, 2.5, 4.0, 6.0, 9.0, 16.0]},
    }),
    # the MoE families: experts with no rows in short steps, a dense layer (mlp_only_layers)
    "qwen3-moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, {
        "head_dim": 24, "num_hidden_layers": 3, "num_experts": 6, "num_experts_per_tok": 2,
        "moe_intermediate_size": 40, "norm_topk_prob": True, "mlp_only_layers": [1], "tie_word_embeddings": True,
    }),
    "qwen2-moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM, {  # a shared expert; top-k weights not renormalised
        "num_experts": 5, "num_experts_per_tok": 2, "moe_intermediate_size": 40,
        "shared_expert_intermediate_size": 56, "norm_topk_prob": False,
    }),
    "mixtral": (MixtralConfig, MixtralForCausalLM, {"num_local_experts": 4, "num_experts_per_tok": 2}),
}
FAMILIES = ["qwen3", "gemma2", "gemma3"]
MOE_FAMILIES = ["qwen3-moe", "qwen2-moe", "mixtral"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<s>' if loop.first else '' }}{{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


def build_tokenizer(directory) -> None:
    """A word-level tokenizer over the model's whole vocabulary: w0 ... w159, <s> = 1, </s> = 2."""
    vocab = {f"w{i}": i for i in range(VOCAB)}
    vocab.update({"<unk>": 0, "<s>": 1, "</s>": 2, "user": 3, "assistant": 4, ":": 5})
    del vocab["w0"], vocab["w1"], vocab["w2"], vocab["w3"], vocab["w4"], vocab["w5"]
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def build_checkpoint(directory, arch: str, *, seed: int = 0, max_shard_size: str | None = None,
                     num_layers: int | None = None, initializer_range: float = 0.15, **overrides):
    """overrides: config fields other than the family's tiny defaults (ARCHS)."""
    config_cls, model_cls, extra = ARCHS[arch]
    shape = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, **extra, **overrides}
    if num_layers is not None:
        shape["num_hidden_layers"] = num_layers
    config = config_cls(vocab_size=VOCAB, max_position_embeddings=256, initializer_range=initializer_range,
                        bos_token_id=1, eos_token_id=2, **shape)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if arch in FAMILIES or arch in MOE_FAMILIES:  # norms not at their initial ones (or zeros, for Gemma's 1 + w): a missed offset shows
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.add_(torch.randn_like(param) * 0.2)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    build_tokenizer(directory)
    return directory


def build_adapter(base_dir, directory, *, seed: int, r: int, targets: list[str], alpha: float = 16.0, **lora_kwargs):
    """A PEFT adapter with random A and B (PEFT starts B at zero, which would make it a no-op)."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    peft_model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, **lora_kwargs))
    for name, param in peft_model.named_parameters():
        if "lora_A" in name or "lora_B" in name:
            torch.nn.init.normal_(param, std=0.3 / param.shape[-1] ** 0.5 if "lora_A" in name else 0.2)
    peft_model.save_pretrained(directory)
    return directory


class Oracle:
    """transformers + PEFT: each adapter loaded into one PeftModel and switched on alone."""

    def __init__(self, base_dir, adapter_dirs: dict[str, object], quantization_config=None) -> None:
        """quantization_config: passed to from_pretrained (its loading attributes override the checkpoint's); left
        out when None: given as None it would replace the checkpoint's own, and the stored tensors load raw."""
        given = {} if quantization_config is None else {"quantization_config": quantization_config}
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="eager",
                                                    **given).eval()
        self.base = base
        self.model = None
        for name, path in adapter_dirs.items():
            if self.model is None:
                self.model = PeftModel.from_pretrained(base, path, adapter_name=name).eval()
            else:
                self.model.load_adapter(path, adapter_name=name)

    @torch.no_grad()
    def logits(self, token_ids: list[int], adapter: str | None) -> torch.Tensor:
        ids = torch.tensor([token_ids])
        if self.model is None:
            return self.base(ids).logits[0].float()
        if adapter is None:
            with self.model.disable_adapter():
                return self.model(ids).logits[0].float()
        self.model.set_adapter(adapter)
        return self.model(ids).logits[0].float()

    @torch.no_grad()
    def greedy_cached(self, prompt: list[int], adapter: str | None, max_tokens: int):
        """Greedy tokens and the log-probability of each as transformers' generate() makes them: the prompt in
        one call, then one call per token over the KV cache. The same as `greedy` except for a rope that looks
        at the call (LongRoPE: a sequence that grows past the original context keeps the short-factor keys of
        its earlier tokens, as generate() does)."""
        model = self.model if self.model is not None else self.base
        if self.model is not None and adapter is not None:
            self.model.set_adapter(adapter)
        context = self.model.disable_adapter() if self.model is not None and adapter is None else nullcontext()
        tokens, logprobs, past, ids = [], [], None, torch.tensor([prompt])
        with context:
            for _ in range(max_tokens):
                out = model(ids, past_key_values=past, use_cache=True)
                row = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
                tokens.append(int(row.argmax()))
                logprobs.append(float(row.max()))
                past, ids = out.past_key_values, torch.tensor([[tokens[-1]]])
        return tokens, logprobs

    def greedy(self, prompt: list[int], adapter: str | None, max_tokens: int,
               frequency_penalty: float = 0.0, presence_penalty: float = 0.0) -> list[int]:
        tokens = list(prompt)
        for _ in range(max_tokens):
            logits = self.logits(tokens, adapter)[-1]
            out = torch.tensor(tokens[len(prompt):], dtype=torch.int64)
            counts = torch.bincount(out, minlength=logits.shape[0]).float()
            logits = logits - frequency_penalty * counts - presence_penalty * (counts > 0).float()
            tokens.append(int(logits.argmax()))
        return tokens[len(prompt):]


@pytest.fixture(autouse=True, scope="module")
def single_torch_thread():
    """The models here are tiny: one thread is as fast, and far faster on a busy machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def triton_launchers():
    """Every op on its Triton launcher, run by Triton's interpreter on CPU tensors. On a machine with CUDA the
    test is skipped: the interpreter is switched on for the whole process and would leave every later kernel
    interpreted."""
    if torch.cuda.is_available():
        pytest.skip("switches Triton to its interpreter for the process: CPU runs only")
    interpreter.enable()
    yield
    interpreter.disable_routing()


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-models")
    return {
        "llama": build_checkpoint(root / "llama", "llama", seed=1),
        "mistral": build_checkpoint(root / "mistral", "mistral", seed=2, max_shard_size="60KB"),
        "qwen2": build_checkpoint(root / "qwen2", "qwen2", seed=3),
        "qwen3": build_checkpoint(root / "qwen3", "qwen3", seed=4),
        "gemma2": build_checkpoint(root / "gemma2", "gemma2", seed=5),
        "gemma3": build_checkpoint(root / "gemma3", "gemma3", seed=6),
        "qwen2-yarn": build_checkpoint(root / "qwen2-yarn", "qwen2-yarn", seed=7),
        "phi3": build_checkpoint(root / "phi3", "phi3", seed=9),
    }


def run_all(engine) -> dict:
    """Step an LLMEngine until every request has finished; its outputs by request id (the last of each)."""
    outputs = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        steps = engine.num_steps
        for out in engine.step():
            outputs[out.request_id] = out
        if not engine.has_unfinished():
            return outputs
        if engine.num_steps == steps:
            time.sleep(0.002)  # an adapter is loading in the background
    raise AssertionError("engine did not finish")


def random_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(6, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def launch_engine_server(args: list[str], *, log_path: Path, token: str, env: dict | None = None) -> httpx.Client:
    """Starts `python -m engine --port <a free port> *args` with its output in log_path (and `env` added to its
    environment), and returns an httpx client for it under the token, with .process, .log_path and .port set. The
    caller waits (wait_until_healthy) and stops the process."""
    port = free_port()
    env = {**os.environ, "QUILT_ENGINE_TOKEN": token, "PYTHONPATH": str(REPO), **(env or {})}
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "engine", "--port", str(port), *args], cwd=REPO, env=env,
                                   stdout=log, stderr=subprocess.STDOUT)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {token}"},
                          timeout=60)
    client.process, client.log_path, client.port = process, log_path, port
    return client


def wait_until_healthy(process, client, log_path, *, timeout: float = 180) -> None:
    """Waits for an engine server started as `process` to answer /v1/health with 200; fails with its log if it
    exits first or is not healthy within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None, log_path.read_text()
        try:
            if client.get("/v1/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "engine did not become healthy"
        time.sleep(0.2)


def metric(client, name: str, **labels) -> float:
    """One sample of an engine server's /metrics, by name and labels (0 when it has none yet)."""
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0
