"""Multi-turn tool episodes (GSM8K with a calculator) driven through a scripted rollout engine.

The engine plays the model: for each prompt it finds the episode's question and returns the scripted turn,
tokenized, plus the stop token. Where the script writes what the template would, the episode's ids must be
the template's rendering of the whole conversation, tokenized; the loss mask must be exactly the scripted
(model) tokens, and the log-probs the engine's on them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _chat_fixtures import REAL_TOKENIZERS
from lmforge.data.chat import ByteChatFormat, chat_format_for, stop_token_ids
from lmforge.models.tokenizer import ByteTokenizer, load_tokenizer
from lmforge.rl.engines.base import Completion, SamplingSettings
from lmforge.rl.environments import GSM8KCalculatorEnv, tool_style_for
from lmforge.rl.math_answers import answers_match
from lmforge.rl.multi_turn import episode_metrics, run_episodes, turn_seed
from lmforge.rl.tools.calculator import calculate
from lmforge.rl.tools.tool_calls import ToolCall, format_tool_call

GSM8K = Path(__file__).resolve().parent / "fixtures" / "data" / "gsm8k_train.jsonl"
RECORDS = [json.loads(line) for line in GSM8K.read_text().splitlines()[:4]]  # answers 72, 10, 5, 42


def call(expr: str, content: str = "") -> str:
    return (content + "\n" if content else "") + format_tool_call(ToolCall("calculator", {"expression": expr}))


SCRIPTS = {  # question -> the model's turns (text without the stop token)
    RECORDS[0]["prompt"]: [call("48 / 2", "In May she sold half of 48."), call("48 + 24"),
                           "She sold 72 clips in all.\n#### 72"],
    RECORDS[1]["prompt"]: ['<tool_call>\n{"name": "calculator", "arguments": {"expression": "12/60*50"</tool_call>',
                           call("12 / 60 * 50"), "She earned $10.\n#### 10"],
    RECORDS[2]["prompt"]: ["Half of 100 is 50, plus 15 and 30 makes 95.\n#### 4"],  # wrong, no tools
    RECORDS[3]["prompt"]: [call("120 - 36"), call("84 / 2"), call("42 * 1"), call("42")],  # never answers
}


class ScriptedEngine:
    name = "scripted"
    version = -1
    sync_seconds = 0.0

    def __init__(self, tokenizer, stop_id: int, logprobs: bool = True, split: dict[str, list[int]] | None = None):
        self.tok, self.stop_id, self.with_logprobs = tokenizer, stop_id, logprobs
        self.split = split or {}
        self.calls: list[tuple[int, int, int]] = []  # (batch size, max_new_tokens, seed)
        self.turn = -1

    def generate(self, prompts, sampling, *, seed, logprobs=False):
        self.turn += 1
        self.calls.append((len(prompts), sampling.max_new_tokens, seed))
        out = []
        for p in prompts:
            text = self.tok.decode(p, skip_special=False)
            question = next(q for q in SCRIPTS if q in text)
            turns = SCRIPTS[question]
            said = turns[min(self.turn, len(turns) - 1)]
            ids = self.split.get(said) or self.tok.encode(said)
            ids = (ids + [self.stop_id])[: sampling.max_new_tokens]
            lp = [-0.01 * (k + 1) - self.turn for k in range(len(ids))] if logprobs and self.with_logprobs else None
            out.append(Completion(ids, lp))
        return out

    def load_weights(self, model, version):
        pass

    def close(self):
        pass


def setup(family: str):
    if family == "byte":
        tok = ByteTokenizer()
        return tok, ByteChatFormat(tok), [tok.eos_id]
    tok = load_tokenizer(str(REAL_TOKENIZERS / family))
    return tok, chat_format_for(tok), stop_token_ids(tok)


def play(family: str, max_turns: int = 3, **kw):
    tok, chat, stops = setup(family)
    env = GSM8KCalculatorEnv(chat, max_turns=max_turns)
    engine = ScriptedEngine(tok, stops[0], **{k: kw.pop(k) for k in ("logprobs", "split") if k in kw})
    sampling = SamplingSettings(max_new_tokens=kw.pop("max_new_tokens", 200), temperature=1.0, stop_ids=stops)
    episodes = run_episodes(engine, env, RECORDS, chat, tok, sampling, seed=11, logprobs=kw.pop("ask", True), **kw)
    return tok, chat, env, engine, episodes


@pytest.mark.parametrize("family", ["qwen2.5-instruct", "smollm2-135m-instruct", "byte"])
def test_episode_ids_are_the_template_rendering_and_the_mask_is_the_models(family):
    tok, chat, env, engine, episodes = play(family)
    assert env.style.native == (family == "qwen2.5-instruct")
    for e in episodes:
        enc = chat.encode(e.messages, e.tools)
        n, m = len(e.prompt_ids), len(e.completion_ids)
        assert e.prompt_ids + e.completion_ids == enc.ids[: n + m]
        assert len(enc.ids) - (n + m) == (0 if family == "byte" else 1)  # ChatML's "\n" after the last <|im_end|>
        assert e.loss_mask == [int(x) for x in enc.assistant_mask[n: n + m]]
        model = [t for t, k in zip(e.completion_ids, e.loss_mask) if k]
        eot = chat.end_of_turn_ids()[0]
        scripted = [t for said in SCRIPTS[e.record["prompt"]][: e.turns] for t in tok.encode(said) + [eot]]
        assert model == scripted
        engine_lps = [-0.01 * (k + 1) - t for t, said in enumerate(SCRIPTS[e.record["prompt"]][: e.turns])
                      for k in range(len(tok.encode(said)) + 1)]
        assert [lp for lp, k in zip(e.logprobs, e.loss_mask) if k] == engine_lps
        assert all(lp == 0.0 for lp, k in zip(e.logprobs, e.loss_mask) if not k)


def test_episode_outcomes_rewards_and_tool_results():
    tok, chat, env, engine, episodes = play("qwen2.5-instruct")
    got = [(e.end, e.turns, e.tool_calls, e.tool_errors, e.truncated, e.reward) for e in episodes]
    assert got == [("answer", 3, 2, 0, False, 1.0), ("answer", 3, 2, 1, False, 1.0),
                   ("answer", 1, 0, 0, False, 0.0), ("max_turns", 3, 2, 0, True, 0.0)]
    for e in episodes:
        assert e.reward == (float(answers_match(e.final_text, e.record["answer"])) if e.final_text else 0.0)
    natalia = episodes[0].messages
    assert [m["role"] for m in natalia] == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    results = [m["content"] for m in natalia if m["role"] == "tool"]
    assert results == [calculate("48 / 2"), calculate("48 + 24")] == ["24", "72"]
    assert natalia[2]["content"] == "In May she sold half of 48."
    assert natalia[2]["tool_calls"] == [{"type": "function", "function": {"name": "calculator",
                                                                           "arguments": {"expression": "48 / 2"}}}]
    weng = episodes[1].messages
    assert weng[3]["role"] == "tool" and weng[3]["content"].startswith("error: tool call 1: invalid JSON")
    # The last allowed turn's calls are not run: no turn would read their results.
    assert episodes[3].messages[-1]["role"] == "assistant" and episodes[3].final_text is None


def test_episode_metrics_are_the_means_over_episodes():
    *_, episodes = play("qwen2.5-instruct")
    m = episode_metrics(episodes)
    assert m["tools/turns"] == (3 + 3 + 1 + 3) / 4 and m["tools/calls"] == (2 + 2 + 0 + 2) / 4
    assert m["tools/error_rate"] == 1 / 6 and m["tools/truncated"] == 1 / 4 and m["tools/template_errors"] == 0
    tokens = [len(e.completion_ids) for e in episodes]
    assert m["tools/model_tokens"] + m["tools/template_tokens"] == pytest.approx(sum(tokens) / 4)
    assert episode_metrics([])["tools/error_rate"] == 0.0


def test_text_style_describes_tools_in_the_system_message():
    tok, chat, env, engine, episodes = play("smollm2-135m-instruct")
    system = episodes[0].messages[0]
    assert system["role"] == "system" and "<tools>" in system["content"] and '"name": "calculator"' in system["content"]
    assert episodes[0].tools is None
    result = episodes[0].messages[3]
    assert result == {"role": "user", "content": "<tool_response>\n24\n</tool_response>"}
    assert episodes[0].reward == 1.0 and episodes[0].tool_calls == 2


def test_one_generate_call_per_turn_with_all_active_episodes_and_derived_seeds():
    tok, chat, env, engine, episodes = play("qwen2.5-instruct")
    assert [c[0] for c in engine.calls] == [4, 3, 3]  # the third question is answered in the first turn
    seeds = [c[2] for c in engine.calls]
    assert seeds == [turn_seed(11, t) for t in range(3)] and seeds[0] == 11 and len(set(seeds)) == 3
    assert all(0 <= s < 2 ** 63 for s in seeds)


def test_sampled_ids_are_kept_as_sampled_not_retokenized():
    """A model may sample a split the tokenizer would never produce ("S" + "he" for "She"); the episode keeps
    those ids and appends the template's tokens after them."""
    tok, _, _ = setup("qwen2.5-instruct")
    answer = SCRIPTS[RECORDS[0]["prompt"]][2]
    odd = [tok.encode("S")[0], tok.encode("he")[0]] + tok.encode(answer[3:])
    assert tok.decode(odd) == answer and odd != tok.encode(answer)
    *_, episodes = play("qwen2.5-instruct", split={answer: odd})
    e = episodes[0]
    assert e.completion_ids[-len(odd) - 1: -1] == odd and e.reward == 1.0


def test_token_budget_and_cut_turns_truncate():
    *_, episodes = play("qwen2.5-instruct", max_total_tokens=60)
    for e in episodes:
        assert len(e.completion_ids) <= 60
    assert [e.end for e in episodes] == ["token_budget", "token_budget", "answer", "token_budget"]
    assert all(e.reward == 0.0 and e.final_text is None for e in episodes if e.truncated)
    *_, episodes = play("qwen2.5-instruct", max_new_tokens=8)  # every turn is cut off
    assert {e.end for e in episodes} == {"max_new_tokens"} and all(e.turns == 1 for e in episodes)
    assert all(len(e.completion_ids) == 8 and sum(e.loss_mask) == 8 for e in episodes)


def test_a_turn_the_template_cannot_render_ends_that_episode_only():
    """A policy early in training can sample anything, U+E000 (the masking sentinel) included."""
    tok, chat, stops = setup("smollm2-135m-instruct")
    odd = call("1 + 1", "\ue000")
    SCRIPTS["odd question"] = [odd, "#### 2"]
    try:
        engine = ScriptedEngine(tok, stops[0])
        env = GSM8KCalculatorEnv(chat)
        sampling = SamplingSettings(max_new_tokens=200, temperature=1.0, stop_ids=stops)
        episodes = run_episodes(engine, env, [{"prompt": "odd question", "answer": "2"}, RECORDS[0]], chat, tok,
                                sampling, seed=0)
    finally:
        del SCRIPTS["odd question"]
    assert episodes[0].end == "template_error" and "U+E000" in episodes[0].template_error
    assert episodes[0].truncated and episodes[0].reward == 0.0
    assert episodes[1].end == "answer" and episodes[1].reward == 1.0


def test_without_engine_logprobs_the_episode_has_none():
    *_, episodes = play("qwen2.5-instruct", logprobs=False)  # asked for, not reported
    assert all(e.logprobs is None for e in episodes)
    *_, episodes = play("qwen2.5-instruct", ask=False)  # not asked for
    assert all(e.logprobs is None for e in episodes)


def test_style_probes():
    assert tool_style_for(setup("qwen2.5-instruct")[1]).native
    assert not tool_style_for(setup("smollm2-135m-instruct")[1]).native
    byte = tool_style_for(setup("byte")[1])
    assert not byte.native and byte.system_message
    mistral = tool_style_for(chat_format_for(load_tokenizer(str(REAL_TOKENIZERS / "mistral-7b-instruct-v0.1"))))
    assert not mistral.native and not mistral.system_message
    env = GSM8KCalculatorEnv(chat_format_for(load_tokenizer(str(REAL_TOKENIZERS / "mistral-7b-instruct-v0.1"))))
    first = env.start(RECORDS[0]).messages
    assert [m["role"] for m in first] == ["user"] and "<tools>" in first[0]["content"]
    assert first[0]["content"].endswith(RECORDS[0]["prompt"])


def test_environment_turns():
    env = GSM8KCalculatorEnv(setup("qwen2.5-instruct")[1])
    out = env.step(RECORDS[0], [], format_tool_call(ToolCall("abacus", {"x": 1})) +
                   format_tool_call(ToolCall("calculator", {"expression": "1/0"})) +
                   format_tool_call(ToolCall("calculator", {"expr": "1"})))
    assert not out.done and out.tool_calls == 3 and out.tool_errors == 3
    assert [m["content"] for m in out.results] == ["error: division by zero",
                                                   'error: calculator takes one argument, "expression" (a string)',
                                                   "error: unknown tool 'abacus' (available: calculator)"]
    assert [c["function"]["name"] for c in out.assistant["tool_calls"]] == ["calculator", "calculator"]
    many = "".join(format_tool_call(ToolCall("calculator", {"expression": f"{k}+1"})) for k in range(10))
    out = env.step(RECORDS[0], [], many)
    assert [m["content"] for m in out.results] == [str(k + 1) for k in range(8)] + [
        "error: at most 8 tool calls per turn; the rest were not run"]
    assert out.tool_calls == 9 and out.tool_errors == 1 and len(out.assistant["tool_calls"]) == 8
    assert env.reward(RECORDS[0], "#### 72") == 1.0 and env.reward(RECORDS[0], None) == 0.0
    assert env.reward(RECORDS[0], "#### 71") == 0.0


def test_with_the_lmforge_engine_logprobs_line_up_with_the_whole_sequence():
    """A tiny random model behind the real engine: the first turn is a scripted tool call (scored by the
    engine's teacher-forced pass), the second is sampled. Scoring the finished episode in one pass must give
    the engine's log-probs at every model token: the turns' contexts are the episode's own tokens."""
    import torch

    from lmforge.models.model import ModelArgs, Transformer
    from lmforge.rl.engines.lmforge_engine import LmforgeEngine

    tok, chat, stops = setup("byte")
    model = Transformer(ModelArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=tok.vocab_size,
                                  max_seq_len=2048))
    model.init_weights(seed=0)
    model.eval()
    inner = LmforgeEngine(pad_id=tok.pad_id)
    inner.load_weights(model, 0)

    class FirstTurnScripted:
        name, version, sync_seconds = "first-scripted", 0, 0.0

        def __init__(self):
            self.turn = -1

        def generate(self, prompts, sampling, *, seed, logprobs=False):
            self.turn += 1
            if self.turn > 0:
                return inner.generate(prompts, sampling, seed=seed, logprobs=logprobs)
            ids = [tok.encode(call("48 / 2")) + [tok.eos_id] for _ in prompts]
            lps = inner.sampled_logprobs(prompts, ids, sampling.temperature)
            return [Completion(i, lp) for i, lp in zip(ids, lps)]

        def load_weights(self, model, version):
            pass

        def close(self):
            pass

    env = GSM8KCalculatorEnv(chat, max_turns=2)
    sampling = SamplingSettings(max_new_tokens=100, temperature=1.0, stop_ids=stops)
    episodes = run_episodes(FirstTurnScripted(), env, RECORDS[:2], chat, tok, sampling, seed=3, logprobs=True,
                            max_total_tokens=300)
    for e in episodes:
        assert e.turns == 2 and e.tool_calls == 1 and sum(1 - k for k in e.loss_mask) > 0
        whole = inner.sampled_logprobs([e.prompt_ids], [e.completion_ids], 1.0)[0]
        got = torch.tensor([lp for lp, k in zip(e.logprobs, e.loss_mask) if k])
        want = torch.tensor([lp for lp, k in zip(whole, e.loss_mask) if k])
        assert torch.allclose(got, want, atol=1e-4)
        assert all(lp == 0.0 for lp, k in zip(e.logprobs, e.loss_mask) if not k)
