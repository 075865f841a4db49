"""Vision-language SFT end to end: ``lmforge sft`` on the embedded image task (configs/sft_vlm_debug.toml,
shortened), the held-out exact match it reports (equal to greedy decoding's), ``model.freeze``, the tower's
FLOPs in the step's count, and ``lmforge export --hf`` of the run loaded by transformers as an
image-text-to-text model with equal logits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from _helpers import REPO, lmforge_in_process, run_lmforge
from lmforge.data.chat import chat_format_for
from lmforge.data.image_tokens import image_encoding_for
from lmforge.data.packing import IGNORE_INDEX, collate
from lmforge.data.sft_data import build_sft_dataset
from lmforge.data.shape_task import COLOURS, KINDS, shape_example, shape_examples, shape_records
from lmforge.errors import UserError
from lmforge.evaluation.image_tasks import answers_right
from lmforge.metrics.records import read_records
from lmforge.models.args import model_args_for
from lmforge.models.qwen2_5_vl import vision_flops
from lmforge.models.spec import freeze_groups, parameters_of, spec_for_args
from lmforge.models.tokenizer import ByteTokenizer

transformers = pytest.importorskip("transformers")


def debug_model(seed: int = 0):
    tok = ByteTokenizer()
    args = model_args_for("qwen2.5-vl-debug", tok.vocab_size)
    model = spec_for_args(args).build(args)
    model.init_weights(seed)
    return tok, args, model.eval()


def test_shape_task_is_deterministic_and_answerable_only_from_the_image():
    a, b = shape_example("train", 7), shape_example("train", 7)
    assert a == b and a.image().tobytes() == b.image().tobytes()
    train = {e.seed for e in shape_examples("train")}
    assert not train & {e.seed for e in shape_examples("test")}
    test = shape_examples("test")
    for question, choices in [("colour", set(COLOURS)), ("kind", set(KINDS)), ("count", {"1", "2", "3"})]:
        answers = [e.answer for e in test if e.question == question]
        assert set(answers) == choices and max(answers.count(c) for c in choices) < 0.5 * len(answers)


def test_exact_match_is_greedy_decoding():
    """The teacher-forced score is greedy generation's: rows whose labels are the model's own greedy
    continuation (decoded by full forwards with the image) score right, and changing one label makes them wrong."""
    tok, args, model = debug_model()
    enc = image_encoding_for(args, tok)
    records = shape_records(shape_examples("test", 3), "test")
    ds, _ = build_sft_dataset(records, "t", tok, chat_format_for(tok), seq_len=40, packing=False, images=enc)
    rows = []
    for i in range(3):
        s = ds[i]
        start = int((s.labels != IGNORE_INDEX).nonzero()[0])  # the answer's first input position
        ids = s.input_ids[: start + 1].tolist()
        with torch.no_grad():
            for _ in range(3):  # greedy, a full forward per token (images in every forward)
                logits = model(torch.tensor([ids]), pixel_values=s.pixel_values, image_grid_thw=s.image_grid_thw)
                ids.append(int(logits[0, -1].argmax()))
        s.input_ids[: len(ids) - 1] = torch.tensor(ids[:-1])
        s.labels[:] = IGNORE_INDEX
        s.labels[start: len(ids) - 1] = torch.tensor(ids[start + 1:])
        rows.append(s)
    with torch.no_grad():
        assert answers_right(model, collate(rows)).all()
        k = int((rows[1].labels != IGNORE_INDEX).nonzero()[-1])
        rows[1].labels[k] = (rows[1].labels[k] + 1) % 256
        assert answers_right(model, collate(rows)).tolist() == [True, False, True]


def test_freeze_groups_and_tower_flops():
    tok, args, model = debug_model()
    spec = spec_for_args(args)
    tower = sum(p.numel() for _, p in parameters_of(model, spec, "vision_tower"))
    assert freeze_groups(model, spec, ["vision_tower"]) == tower
    assert not any(p.requires_grad for _, p in parameters_of(model, spec, "vision_tower"))
    assert all(p.requires_grad for _, p in parameters_of(model, spec, "projector"))
    with pytest.raises(UserError, match="no parameter group 'tower'"):
        freeze_groups(model, spec, ["tower"])
    grid = torch.tensor([[1, 4, 4], [1, 4, 6]])
    forward = spec.image_flops(args, grid, 2, False)
    assert spec.image_flops(args, grid, 2, True) == vision_flops(args, grid) == 3 * forward


def test_step_flops_count_the_tower():
    """A step's FLOPs are the decoder's over all tokens plus the tower's over the step's images: forward and
    backward, or the forward alone with the tower and projector frozen."""
    from lmforge.recipes.jobs.next_token import LoaderSource
    from lmforge.runtime.model_bundle import ModelBundle

    tok, args, _ = debug_model()
    enc = image_encoding_for(args, tok)
    ds, summary = build_sft_dataset(shape_records(shape_examples("train", 30), "train"), "t", tok,
                                    chat_format_for(tok), seq_len=128, images=enc)
    for trains in (True, False):
        bundle = SimpleNamespace(spec=spec_for_args(args), args=args, tower_trains=trains)
        rt = SimpleNamespace(
            cfg=SimpleNamespace(training=SimpleNamespace(global_batch_size=2, micro_batch_size=1, seed=0),
                                data=SimpleNamespace(shuffle=False, prefetch=0),
                                checkpoint=SimpleNamespace(on_data_change="error")),
            metrics=SimpleNamespace(console=print),
            model=SimpleNamespace(training_flops=lambda lengths: 0.0,
                                  image_flops=lambda grid, n, b=bundle: ModelBundle.image_flops(b, grid, n)),
            world=SimpleNamespace(shard_batch=lambda b: b, layout=SimpleNamespace(cp=1),
                                  dist=SimpleNamespace(batch_share=0, batch_shares=1, device="cpu")))
        step = LoaderSource(rt, ds).next_step(1)
        grid = torch.cat([ds[0].image_grid_thw, ds[1].image_grid_thw])
        assert step.flops == vision_flops(args, grid, training=trains) > 0


@pytest.mark.parametrize("mode", ["--model.freeze=vision_tower", "--lora.enabled=true"])
def test_sft_on_the_image_task_then_export_loads_in_transformers(tmp_path, mode, capfd):
    """Full SFT with the tower frozen (the checkpoint holds it) and LoRA (merged into the rebuilt random base);
    ``lmforge generate --image`` of the run, a missing image one line."""
    run, out = tmp_path / "run", tmp_path / "hf"
    result = run_lmforge("sft", "--config", REPO / "configs" / "sft_vlm_debug.toml", f"--run.dir={run}",
                         "--training.steps=3", "--tasks.train_examples=64", "--tasks.eval_examples=12",
                         "--eval.interval=3", "--training.threads=1", "--metrics.tensorboard=false",
                         "--metrics.peak_tflops=1", "--metrics.progress=off", mode,
                         "--data.validation=none")
    assert result.returncode == 0, result.stderr[-3000:]
    evals = read_records(run, "eval")
    assert [r["step"] for r in evals if "exact_match_colour" in r] == [0, 3]
    tok, args, _ = debug_model()

    picture = tmp_path / "red.png"
    shape_example("test", 0).image().save(picture)
    assert lmforge_in_process("generate", run, "--image", picture, "--prompt", "colour?", "--max-new-tokens=3") == 0
    assert lmforge_in_process("generate", run, "--image", tmp_path / "none.png", "--prompt", "colour?") == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: image ") and err[-1].endswith("none.png: no such file")
    assert lmforge_in_process("export", "--hf", out, run) == 0
    assert (out / "preprocessor_config.json").is_file()
    from transformers import AutoModelForImageTextToText, AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from lmforge.inference import load_for_inference

    ours, _ = load_for_inference(run)
    theirs = AutoModelForImageTextToText.from_pretrained(out).eval()
    assert type(theirs).__name__ == "Qwen2_5_VLForConditionalGeneration"
    hf_tok = AutoTokenizer.from_pretrained(out)
    processor = Qwen2VLImageProcessorPil.from_pretrained(out)
    pics = [shape_example("test", 0).image(), shape_example("test", 1).image()]
    pixels = processor(images=pics, return_tensors="pt")
    text = "<|user|>" + "<|vision_start|>" + "<|image_pad|>" * 4 + "<|vision_end|>colour?<|end|><|assistant|>"
    ids = torch.tensor([hf_tok(text + text.replace("colour?", "how many?"))["input_ids"]])
    assert (ids == args.image_token_id).sum() == 8
    with torch.no_grad():
        # mm_token_type_ids as transformers' processor returns them (its positions follow them)
        want = theirs(input_ids=ids, pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                      mm_token_type_ids=(ids == args.image_token_id).int()).logits
        got = ours(ids, pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_resume_is_exact(tmp_path):
    """A VLM SFT run stopped at step 2 and resumed gives the same losses as the run straight through
    (the same packed rows, images and order after the resume)."""
    common = ["sft", "--config", REPO / "configs" / "sft_vlm_debug.toml", "--tasks.train_examples=48",
              "--tasks.eval_examples=0", "--eval.interval=0", "--training.threads=1", "--metrics.tensorboard=false",
              "--metrics.peak_tflops=1", "--metrics.progress=off", "--data.validation=none", "--metrics.log_every=1",
              "--checkpoint.interval=2", "--eval.at_start=false"]
    straight, resumed = tmp_path / "a", tmp_path / "b"
    for run, steps in ((straight, 4), (resumed, 2), (resumed, 4)):
        assert lmforge_in_process(*common, f"--run.dir={run}", f"--training.steps={steps}") == 0
    losses = [{r["step"]: r["loss"] for r in read_records(run, "train")} for run in (straight, resumed)]
    assert losses[0][3] == losses[1][3] and losses[0][4] == losses[1][4]
