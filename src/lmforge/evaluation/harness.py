"""Standard benchmark scores: lmforge models inside EleutherAI's lm-evaluation-harness (``lm-eval``).

:class:`LMForgeLM` is the harness's ``LM`` interface over an lmforge model and tokenizer. It follows
the harness's own ``hf`` model type step for step, so a score here is the score ``lm_eval --model hf``
gives on the exported Hugging Face directory: the same context/continuation split (``TemplateLM``),
the same BOS handling, the same rolling windows, the same stop-string truncation. Only the compute is
lmforge's: batched forward passes (log-softmax in fp32 on the scored positions only) and the KV-cache
generator.

:func:`evaluate_tasks` runs tasks by name: the harness's own, task YAMLs in ``include_path`` (with
local ``data_files``: nothing is downloaded here), and the shipped ``lmforge_tasks`` built from the
embedded tasks (``harness_tasks/``). :class:`DownstreamEval` runs them inside training.
"""

from __future__ import annotations

import contextlib
import functools
import io
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from lmforge.data.chat import BYTE_CHAT_TEMPLATE, chat_format_for, stop_token_ids
from lmforge.data.chat_template import ChatTemplate
from lmforge.errors import UserError
from lmforge.models.generate import generate
from lmforge.models.model import Transformer
from lmforge.models.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

SHIPPED_TASKS = Path(__file__).with_name("harness_tasks")
"""Task YAMLs of the embedded tasks: the group ``lmforge_tasks`` and its ``lmforge_*`` tasks."""
INSTALL_HINT = "lmforge eval needs lm-eval (EleutherAI lm-evaluation-harness): pip install 'lmforge[eval]'"

try:  # the harness is an optional extra: without it this module still imports, and says how to get it
    from lm_eval.api.model import TemplateLM
except ImportError:  # pragma: no cover - exercised by patching the import in the tests
    TemplateLM = object  # type: ignore[misc,assignment]


def require_lm_eval() -> None:
    """Raise a one-line :class:`UserError` naming the extra to install when ``lm-eval`` is missing."""
    try:
        import lm_eval  # noqa: F401
        from lm_eval.api.model import TemplateLM  # noqa: F401
    except ImportError:
        raise UserError(INSTALL_HINT) from None


def _adds_bos(tokenizer: Tokenizer) -> bool:
    """Whether ``transformers`` adds BOS when encoding plain text with this tokenizer (the ``hf`` model's
    default): ``add_bos_token`` of tokenizer_config.json, else what tokenizer.json's post-processor does."""
    if not isinstance(tokenizer, HFTokenizer):
        return False  # the exported byte tokenizer adds nothing
    config = HFTokenizer._read_config(tokenizer.path / "tokenizer_config.json")
    if isinstance(config.get("add_bos_token"), bool):
        return config["add_bos_token"]
    from tokenizers import Tokenizer as RustTokenizer

    probe = RustTokenizer.from_file(str(tokenizer.path / "tokenizer.json"))
    with_specials = probe.encode("a", add_special_tokens=True).ids
    return len(with_specials) > len(probe.encode("a", add_special_tokens=False).ids) \
        and with_specials[0] == tokenizer.bos_id


class LMForgeLM(TemplateLM):  # type: ignore[misc,valid-type]
    """The harness's ``LM`` for an lmforge model (see the module doc)."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, *, batch_size: int = 16,
                 max_gen_toks: int = 256) -> None:
        require_lm_eval()
        super().__init__()
        self.model = model
        self.lm_tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_gen_toks = max_gen_toks
        self.add_bos = _adds_bos(tokenizer)
        self.bos_text = tokenizer.decode([tokenizer.bos_id], skip_special=False)
        self.stop_ids = stop_token_ids(tokenizer)
        literals = sorted(tokenizer.control_tokens, key=len, reverse=True)
        self._specials = re.compile("(" + "|".join(map(re.escape, literals)) + ")") if literals else None

    # -- what TemplateLM asks for ------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.lm_tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.lm_tokenizer.bos_id  # lmforge's BOS already falls back to EOS, as the hf model's does

    @property
    def max_length(self) -> int:
        return self.model.args.max_seq_len

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.lm_tokenizer, "path", "lmforge-byte")).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if chat_template is False or chat_template is None:
            return None
        return self._chat_template_text()

    def _encode(self, text: str) -> list[int]:
        """Text to ids with special-token literals as their ids, as a ``transformers`` tokenizer does
        (lmforge's byte tokenizer encodes every character as bytes, so chat renderings are split here)."""
        if not isinstance(self.lm_tokenizer, ByteTokenizer) or self._specials is None:
            return self.lm_tokenizer.encode(text)
        ids: list[int] = []
        for i, part in enumerate(self._specials.split(text)):
            ids += [self.lm_tokenizer.control_tokens[part]] if i % 2 else self.lm_tokenizer.encode(part)
        return ids

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs: Any) -> list[int]:
        add = self.add_bos if add_special_tokens is None else add_special_tokens
        if add_special_tokens is None and string.startswith(self.bos_text):
            add = False  # already there (a chat rendering writes its own BOS)
        ids = ([self.lm_tokenizer.bos_id] if add and self.add_bos else []) + self._encode(string)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.lm_tokenizer.decode(tokens, skip_special=skip_special_tokens)

    # -- scoring -------------------------------------------------------------------------------------
    @torch.no_grad()
    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
                              override_bs: int | None = None) -> list[tuple[float, bool]]:
        """``(sum of log p(continuation), whether greedy decoding gives it)`` per request.

        Longest first, ``batch_size`` at a time, right-padded (causal attention: padding after a row
        never changes its logits); the input is the last ``max_length`` tokens of context +
        continuation without its final token, as in the harness's ``hf`` model."""
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        out: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        was_training = self.model.training
        self.model.eval()
        try:
            for lo in range(0, len(order), override_bs or self.batch_size):
                chunk = order[lo: lo + (override_bs or self.batch_size)]
                for i, result in zip(chunk, self._score_batch([requests[i] for i in chunk])):
                    out[i] = result
        finally:
            self.model.train(was_training)
        return out

    def _score_batch(self, batch: list[tuple[Any, list[int], list[int]]]) -> list[tuple[float, bool]]:
        inputs, conts = [], []
        for _, context, continuation in batch:
            if not context or not continuation or len(continuation) > self.max_length:
                raise UserError("loglikelihood: a request has an empty context or continuation, or a "
                                f"continuation longer than the model's {self.max_length} tokens")
            inputs.append((context + continuation)[-(self.max_length + 1):][:-1])
            conts.append(continuation)
        width = max(len(x) for x in inputs)
        tokens = torch.tensor([x + [self.lm_tokenizer.pad_id] * (width - len(x)) for x in inputs],
                              dtype=torch.long, device=self.device)
        hidden = self.model.hidden_states(tokens)
        rows = torch.cat([hidden[b, len(x) - len(c): len(x)] for b, (x, c) in enumerate(zip(inputs, conts))])
        logprobs = torch.log_softmax(self.model.output(rows).float(), dim=-1)
        targets = torch.tensor([t for c in conts for t in c], dtype=torch.long, device=self.device)
        picked = logprobs.gather(1, targets[:, None]).squeeze(1).tolist()
        greedy = (logprobs.argmax(dim=-1) == targets).tolist()
        results, at = [], 0
        for c in conts:
            results.append((float(sum(picked[at: at + len(c)])), all(greedy[at: at + len(c)])))
            at += len(c)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole texts, in the harness's disjoint windows of at most ``max_length``."""
        from lm_eval import utils

        windows: list[tuple[None, list[int], list[int]]] = []
        counts = []
        for (text,) in (r.args for r in requests):
            rolling = utils.get_rolling_token_windows(token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                                                      max_seq_len=self.max_length, context_len=1)
            mine = [(None, *utils.make_disjoint_window(w)) for w in rolling]
            windows += mine
            counts.append(len(mine))
        scores = self._loglikelihood_tokens(windows)  # type: ignore[arg-type]
        totals, at = [], 0
        for n in counts:
            totals.append(sum(s for s, _ in scores[at: at + n]))
            at += n
        return totals

    # -- generation -----------------------------------------------------------------------------------
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, if a task asks) continuations from the KV-cache generator, cut at the
        first of the task's stop strings (and EOS); a row also stops at the tokenizer's stop tokens."""
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

        out: list[str] = [""] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(repr(sorted(r.args[1].items())), []).append(i)
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        for members in groups.values():
            kwargs = normalize_gen_kwargs(requests[members[0]].args[1], self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_new = int(kwargs.pop("max_gen_toks"))
            if max_new >= self.max_length:
                raise UserError(f"a task asks for {max_new} new tokens; the model holds {self.max_length}")
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
            prompts = {i: self.tok_encode(requests[i].args[0], left_truncate_len=self.max_length - max_new)
                       or [self.prefix_token_id] for i in members}
            order = sorted(members, key=lambda i: -len(prompts[i]))
            for lo in range(0, len(order), self.batch_size):
                chunk = order[lo: lo + self.batch_size]
                rows = generate(self.model, [prompts[i] for i in chunk], max_new, stop_ids=self.stop_ids,
                                pad_id=self.lm_tokenizer.pad_id, temperature=temperature,
                                top_p=float(kwargs.get("top_p", 1.0) or 1.0))
                for i, row in zip(chunk, rows):
                    out[i] = postprocess_generated_text(self.tok_decode(row), until, None)
        return out

    # -- chat ----------------------------------------------------------------------------------------
    def _chat_template_text(self) -> str:
        """The template's text (the harness records it with the results)."""
        if isinstance(self.lm_tokenizer, ByteTokenizer):
            return BYTE_CHAT_TEMPLATE
        if self.lm_tokenizer.chat_template:
            return self.lm_tokenizer.chat_template
        jinja = Path(getattr(self.lm_tokenizer, "path", ".")) / "chat_template.jinja"
        return jinja.read_text(encoding="utf-8") if jinja.is_file() else ""

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat rendered as text (special tokens as literals), as ``transformers``'
        ``apply_chat_template(tokenize=False)`` gives it to the ``hf`` model: a reply still being
        written (``add_generation_prompt=False``) ends right after its text."""
        if isinstance(self.lm_tokenizer, ByteTokenizer):
            t = self.lm_tokenizer
            strings = {"bos_token": t.decode([t.bos_id], skip_special=False),
                       "eos_token": t.decode([t.eos_id], skip_special=False)}
            text = ChatTemplate(BYTE_CHAT_TEMPLATE, strings, "byte chat template").render(chat_history, add_generation_prompt)
        else:
            fmt = chat_format_for(self.lm_tokenizer)
            text = fmt.render(chat_history, add_generation_prompt=add_generation_prompt)  # type: ignore[attr-defined]
        if not add_generation_prompt and chat_history and chat_history[-1]["role"] == "assistant":
            last = chat_history[-1]["content"].strip()
            end = text.rfind(last)
            if last and end >= 0:
                text = text[: end + len(last)]
        return text


# -- running tasks --------------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def _index(paths: tuple[str, ...], include_defaults: bool) -> Any:
    """A harness task index, kept for the process: indexing the harness's own ~15k tasks takes seconds."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(paths), include_defaults=include_defaults)


def _task_manager(tasks: Sequence[str], include_path: str | Path | None) -> Any:
    """The harness's task index over the shipped tasks and ``include_path``; its built-in tasks are
    indexed too only when a requested name is not found in those."""
    if include_path and not Path(include_path).expanduser().is_dir():
        raise UserError(f"--include-path {include_path}: not a directory")
    paths = (str(SHIPPED_TASKS),) + ((str(Path(include_path).expanduser().resolve()),) if include_path else ())
    manager = _index(paths, False)
    if all(t in manager.all_tasks for t in tasks):
        return manager
    manager = _index(paths, True)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        broken = _unreadable_yaml(Path(include_path).expanduser()) if include_path else ""
        raise UserError(f"unknown task(s) {', '.join(unknown)}: not a harness task, not in lmforge_tasks"
                        + (f", not in {include_path}" if include_path else " (give task YAMLs with --include-path)")
                        + (f" ({broken})" if broken else ""))
    return manager


def _unreadable_yaml(include_path: Path) -> str:
    """The first task YAML under ``include_path`` that does not parse, as ``FILE:LINE: reason`` (the
    harness skips such a file without a word, so its task is merely "unknown"); "" if all parse."""
    import yaml

    class Loader(yaml.SafeLoader):  # the harness's own tags (!function) are not checked here
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    for f in sorted(include_path.rglob("*.yaml")):
        try:
            yaml.load(f.read_text(), Loader=Loader)
        except (OSError, UnicodeDecodeError) as e:
            return f"{f}: unreadable ({e})"
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            return f"{f}:{mark.line + 1 if mark else '?'}: not valid YAML ({getattr(e, 'problem', None) or e})"
    return ""


@contextmanager
def _quiet() -> Iterator[None]:
    """No progress bars or notes from the harness (tqdm draws on stderr; its env switch is read at import)."""
    with contextlib.redirect_stderr(io.StringIO()):
        yield


def is_chat_task(name: str) -> bool:
    """The shipped embedded tasks are chat tasks: their prompts are what SFT puts in a user turn."""
    return name.startswith("lmforge_")


def evaluate_tasks(model: Transformer, tokenizer: Tokenizer, tasks: Sequence[str], *, limit: int | float | None = None,
                   apply_chat_template: bool | None = None, batch_size: int = 16, include_path: str | Path | None = None,
                   log_samples: bool = False, bootstrap_iters: int = 100_000, quiet: bool = False) -> dict[str, Any]:
    """The harness's results dict (``results``, ``groups``, ``configs``, ...) of ``tasks`` on the model.

    ``apply_chat_template=None`` applies the chat template exactly when every task is a shipped
    ``lmforge_*`` task (the harness's own tasks are scored on plain text unless asked). ``quiet`` (inside
    training) hides the harness's progress bars and leaves the global random generators alone.
    """
    require_lm_eval()
    import logging

    from lm_eval import simple_evaluate

    tasks = [t.strip() for t in tasks if t.strip()]
    if not tasks:
        raise UserError("no tasks given (e.g. --tasks lmforge_tasks)")
    if apply_chat_template is None:
        apply_chat_template = all(is_chat_task(t) for t in tasks)
    manager = _task_manager(tasks, include_path)
    lm = LMForgeLM(model, tokenizer, batch_size=batch_size)
    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its notes on custom datasets, caches, ...
    try:
        # Quiet runs happen inside training: the harness's reseeding of the global RNGs is left out there.
        seeds = {"random_seed": None, "numpy_random_seed": None, "torch_random_seed": None} if quiet else {}
        with _quiet() if quiet else contextlib.nullcontext():
            results = simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit,
                                      apply_chat_template=apply_chat_template, log_samples=log_samples,
                                      bootstrap_iters=bootstrap_iters, **seeds)
    except (FileNotFoundError, ValueError, ImportError) as e:  # a task's data_files, config or !function
        raise UserError(f"task {', '.join(tasks)}: {e}") from None
    if results is None:
        raise UserError("the harness returned no results")
    return results


def flat_scores(results: dict[str, Any]) -> dict[str, float]:
    """``{"<task>/<metric>": value}`` of every task and group (stderr left out; a filter other than the
    default ``none`` stays in the metric name: ``exact_match_strict-match``)."""
    scores: dict[str, float] = {}
    for section in ("results", "groups"):
        for task, values in (results.get(section) or {}).items():
            for key, value in values.items():
                metric, _, filt = key.partition(",")
                if "_stderr" in metric or metric == "sample_len" or not isinstance(value, (int, float)) or isinstance(value, bool):
                    continue
                scores[f"{task}/{metric if filt in ('', 'none') else f'{metric}_{filt}'}"] = float(value)
    return scores


# -- the command ------------------------------------------------------------------------------------
def results_dir(model_path: str | Path) -> Path:
    """Where ``lmforge eval`` keeps results: the run directory of a run or of a checkpoint in one, else
    the model directory itself; always in its ``eval/`` folder."""
    from lmforge.checkpoint import RunDir

    p = Path(model_path).expanduser().resolve()
    home = next((d for d in (p, p.parent.parent) if RunDir(d).is_run()), p)
    return home / "eval"


def run_eval(model_path: str, tasks: Sequence[str], *, limit: float | None = None,
             apply_chat_template: bool | None = None, batch_size: int = 16, include_path: str | None = None,
             out: str | None = None, device: str | None = None) -> int:
    """``lmforge eval``: score, print the harness's tables, write the results JSON."""
    import json
    import time

    from lm_eval.utils import handle_non_serializable, make_table

    from lmforge.inference import load_for_inference

    if limit is not None and limit <= 0:
        raise UserError(f"--limit {limit}: must be positive (a count, or a fraction below 1)")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_for_inference(model_path, device)
    results = evaluate_tasks(model, tokenizer, tasks, limit=int(limit) if limit and limit >= 1 else limit,
                             apply_chat_template=apply_chat_template, batch_size=batch_size, include_path=include_path)
    results["config"].update(model="lmforge", model_args=str(model_path), batch_size=batch_size, device=device)
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    path = Path(out).expanduser() if out else results_dir(model_path) / f"results_{time.strftime('%Y%m%d-%H%M%S')}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2, default=handle_non_serializable) + "\n")
    except OSError as e:
        raise UserError(f"cannot write the results to {path} ({e.strerror or e})") from None
    print(f"results: {path}")
    return 0
