"""The engine and the CLI on a CUDA device, with tiny random models: skipped where no GPU is visible (CI).

The same promises as on the CPU (tests/test_engine.py): in fp32 EAGLE-3 gives the target's greedy tokens, DropMatch
with K=0 or p=0 is EAGLE-3 bit for bit, the selective sample rows decide as all rows, and a seed fixes a lossy run.
"""

import json

import pytest
import torch

from eagle_dropmatch import gen
from eagle_dropmatch.drafters import Eagle3Drafter
from eagle_dropmatch.dropmatch import DropMatchConfig
from eagle_dropmatch.generate import DecodeConfig, RoundTimer, SpeculativeDecoder

from conftest import OracleDrafter, greedy_reference, tiny_head, tiny_target

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible")

AUX = [2, 4, 5]
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=1).to(CUDA)


def prompts(n, vocab=96, seed=0):
    gen_ = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(3, 20, (1,), generator=gen_)),), generator=gen_)
            for _ in range(n)]


@pytest.mark.parametrize("shape", [(8, 3, 2), (60, 6, 10)])
def test_eagle3_greedy_equals_plain_greedy_on_cuda(target, shape):
    engine = SpeculativeDecoder(target, AUX)
    drafter = Eagle3Drafter(tiny_head(target, seed=3, draft_vocab=48).to(CUDA), *shape)
    cfg = DecodeConfig(max_new_tokens=40)
    for prompt in prompts(3):
        reference = greedy_reference(target, prompt.to(CUDA), 40)
        assert engine.generate_baseline(prompt, cfg).token_ids == reference
        out = engine.generate(prompt, drafter, cfg)
        assert out.token_ids == reference
        assert sum(out.accept_lengths) == 40 and out.exact_accept_lengths == out.accept_lengths


def test_long_accepted_runs_stay_exact_on_cuda(target):
    engine = SpeculativeDecoder(target, AUX)
    for i, prompt in enumerate(prompts(3, seed=5)):
        reference = greedy_reference(target, prompt.to(CUDA), 50)
        out = engine.generate(prompt, OracleDrafter(reference, depth=6, vocab=96, error_rate=0.3, seed=i),
                              DecodeConfig(max_new_tokens=50))
        assert out.token_ids == reference and out.tau > 3.0


@pytest.mark.parametrize("dm", [DropMatchConfig(k=0, p=0.3), DropMatchConfig(k=5, p=0.0)])
def test_dropmatch_off_is_bit_identical_to_exact_on_cuda(target, dm):
    engine = SpeculativeDecoder(target, AUX)
    drafter = Eagle3Drafter(tiny_head(target, seed=3).to(CUDA), 16, 4, 4)
    for temperature in (0.0, 0.8):
        for prompt in prompts(2, seed=7):
            exact = engine.generate(prompt, drafter, DecodeConfig(max_new_tokens=30, temperature=temperature, seed=11))
            off = engine.generate(prompt, drafter, DecodeConfig(max_new_tokens=30, temperature=temperature, seed=11,
                                                                dropmatch=dm))
            assert off.token_ids == exact.token_ids and off.accept_lengths == exact.accept_lengths


def test_dropmatch_rows_decide_alike_and_a_seed_fixes_the_run_on_cuda(target):
    """All rows, reachable and contested rows give the same tokens and rounds on the GPU (the contest runs in
    Python there); the same seed gives the same run twice; DropMatch never accepts less than exact matching."""
    engine = SpeculativeDecoder(target, AUX)
    gained = 0
    for i, prompt in enumerate(prompts(3, seed=21)):
        reference, second = greedy_reference(target, prompt.to(CUDA), 30, runner_up=True)
        for make_drafter in (
                lambda: OracleDrafter(reference, depth=5, vocab=96, error_rate=0.8, seed=i, runner_up=second),
                lambda: Eagle3Drafter(tiny_head(target, seed=i).to(CUDA), 16, 4, 4)):
            out = {how: engine.generate(prompt, make_drafter(), DecodeConfig(
                max_new_tokens=30, seed=i, dropmatch=DropMatchConfig(k=5, p=0.3, rows=how)))
                for how in ("all", "reachable", "contested")}
            for how in ("reachable", "contested"):
                assert out[how].token_ids == out["all"].token_ids
                assert out[how].accept_lengths == out["all"].accept_lengths
            again = engine.generate(prompt, make_drafter(), DecodeConfig(
                max_new_tokens=30, seed=i, dropmatch=DropMatchConfig(k=5, p=0.3)))
            assert again.token_ids == out["all"].token_ids and again.accept_lengths == out["all"].accept_lengths
            a = out["all"]
            assert all(x >= e for x, e in zip(a.accept_lengths, a.exact_accept_lengths))
            gained += sum(a.accept_lengths) - sum(a.exact_accept_lengths)
    assert gained > 0


def test_bf16_dropmatch_runs_and_times_every_section_on_cuda():
    target16 = tiny_target(seed=1).to(device=CUDA, dtype=torch.bfloat16)
    engine = SpeculativeDecoder(target16, AUX)
    drafter = Eagle3Drafter(tiny_head(target16, seed=3).to(device=CUDA, dtype=torch.bfloat16), 16, 4, 4)
    timer = RoundTimer(CUDA)
    out = engine.generate(prompts(1)[0], drafter, DecodeConfig(
        max_new_tokens=20, dropmatch=DropMatchConfig(k=5, p=0.3, rows="contested")), timer=timer)
    assert len(out.token_ids) == 20 and all(0 <= t < 96 for t in out.token_ids)
    assert all(a >= e for a, e in zip(out.accept_lengths, out.exact_accept_lengths))
    assert set(timer.totals) == {"prefill", "draft", "target", "lm_head", "dropmatch", "bookkeeping"}


@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_gen_cli_on_cuda_matches_its_baseline(tiny_model_dir, tmp_path, capsys, device):
    """``python -m eagle_dropmatch.gen --device cuda`` (and ``auto``, accelerate's device map) answers in fp32
    with the tokens of plain greedy decoding on the same device; a DropMatch run records its agreement."""
    d = tiny_model_dir

    def run(name, *extra):
        answers = tmp_path / f"{name}.jsonl"
        code = gen.main(["--model-path", str(d / "target"), "--ea-model-path", str(d / "head"), "--question-file",
                         str(d / "questions.jsonl"), "--answer-file", str(answers), "--device", device,
                         "--no-progress", "--dtype", "float32", "--max-new-tokens", "12", *extra])
        assert code == 0, capsys.readouterr().err
        return [json.loads(line)["choices"][0] for line in answers.read_text().splitlines()]

    eagle, base, dm = run("eagle3"), run("base", "--baseline"), run("dm", "--dropmatch-k", "5")
    assert [c["token_ids"] for c in eagle] == [c["token_ids"] for c in base]
    assert all(0.0 <= a <= 1.0 for c in dm for a in c["agreement"] if a is not None)
