"""The demo checkpoint: each adapter's skill shows on held-out prompts, through the engine and through PEFT."""

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoTokenizer, LlamaForCausalLM

from engine import LLM, SamplingParams
from engine.demo import corpus
from engine.demo.builder import RECIPES, STAMP, adapter_dir, ensure_demo

REPO = Path(__file__).resolve().parents[2]
SKILLS = [recipe.skill for recipe in RECIPES]
HELD_OUT = corpus.held_out_sentences(5)


@pytest.fixture(scope="module")
def demo_dir() -> Path:
    """Built once and cached under var/ (the build takes a minute or two on CPU)."""
    return ensure_demo(REPO / "var" / "demo-model")


@pytest.fixture(scope="module")
def llm(demo_dir):
    llm = LLM(model=demo_dir, device="cpu")
    for skill in SKILLS:
        llm.add_adapter(skill, adapter_dir(demo_dir, skill))
    return llm


def chat(llm, text: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def answers(llm, prompts: list[str], adapter: str | None) -> list[str]:
    outputs = llm.generate([chat(llm, p) for p in prompts], sampling=SamplingParams(temperature=0, max_tokens=64),
                           adapters=[adapter] * len(prompts))
    assert all(o.finish_reason == "stop" for o in outputs), [o.text for o in outputs]
    return [o.text.strip() for o in outputs]


def test_demo_files_are_a_hugging_face_checkpoint_with_peft_adapters(demo_dir):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (demo_dir / name).is_file(), name
    assert "chat_template" in json.loads((demo_dir / "tokenizer_config.json").read_text())
    assert json.loads((demo_dir / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    for skill in SKILLS:
        assert {p.name for p in adapter_dir(demo_dir, skill).iterdir()} >= {
            "adapter_config.json", "adapter_model.safetensors"}
    assert json.loads((demo_dir / STAMP).read_text())["adapters"].keys() == set(SKILLS)


def test_held_out_prompts_never_appear_in_training():
    assert all(corpus.is_held_out(p) for p in HELD_OUT)
    rng = corpus.random.Random(0)
    assert not any(corpus.is_held_out(corpus.base_example(rng).user.split(": ")[-1]) for _ in range(2000))


def test_the_tokenizer_spells_the_extract_adapters_json_with_the_words_it_copies(demo_dir):
    """Each word of an extract answer is one token, as in the prompt it comes from. When verbs stood in JSON as
    pieces the tokenizer had never joined (no leading space), the adapter learnt its skill on some builds only."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    for sentence in corpus.held_out_sentences(16):
        fields = json.loads(corpus.extract_fields(sentence))
        pieces = tokenizer.encode(corpus.extract_fields(sentence), add_special_tokens=False).tokens
        for word in " ".join(fields.values()).split():
            assert word in pieces or "\u0120" + word in pieces, (word, pieces)


@pytest.mark.parametrize("skill", [None, *SKILLS], ids=["base-echo", *SKILLS])
def test_each_adapter_shows_its_skill_on_held_out_prompts(llm, skill):
    said = answers(llm, HELD_OUT, skill)
    failures = [(p, a) for p, a in zip(HELD_OUT, said, strict=True) if not corpus.behaves(skill, p, a)]
    assert not failures, failures


def test_one_prompt_gets_visibly_different_answers_per_adapter(llm):
    prompt = HELD_OUT[0]
    outputs = llm.generate([chat(llm, prompt)] * (len(SKILLS) + 1), sampling=SamplingParams(temperature=0, max_tokens=64),
                           adapters=[None, *SKILLS])  # one mixed batch
    said = [o.text.strip() for o in outputs]
    assert len(set(said)) == len(SKILLS) + 1, said


def test_engine_answers_match_transformers_and_peft(demo_dir, llm):
    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    base = LlamaForCausalLM.from_pretrained(demo_dir)
    model = PeftModel.from_pretrained(base, adapter_dir(demo_dir, SKILLS[0]), adapter_name=SKILLS[0])
    for skill in SKILLS[1:]:
        model.load_adapter(adapter_dir(demo_dir, skill), adapter_name=skill)
    prompt = HELD_OUT[1]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    for skill in SKILLS:
        model.set_adapter(skill)
        with torch.inference_mode():
            expected = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                                      do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:].tolist()
        if expected and expected[-1] == tokenizer.eos_token_id:
            expected = expected[:-1]
        (output,) = llm.generate([ids[0].tolist()], sampling=SamplingParams(temperature=0, max_tokens=24),
                                 adapters=[skill])
        assert [t for t in output.token_ids if t != tokenizer.eos_token_id] == expected, skill
