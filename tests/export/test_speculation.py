"""Speculative decoding in the Runner against untouched transformers: with proposals checked in one call, greedy
generation must still be HF `generate`'s, token for token, whatever the proposals (prompt lookup, the right tokens
with one wrong at each position of a draft, or nothing but wrong ones, whose rows the program writes and must never
read); sampling must keep the program's distribution. Dynamic programs here (XNNPACK, with a `verify` method);
static ones beside the other static tests (`test_static_programs.py`)."""

from __future__ import annotations

import numpy
import pytest
import torch
from hf_models import SCORE_ATOL, VOCAB, WINDOW, hf_greedy, hf_log_probs, prompt_ids, swapped_family, tiny_model
from speculation_refs import MAX_DRAFT, NEW_TOKENS, PROMPTS, check_greedy_with_speculation

import etblocks
from etblocks.errors import ConfigError
from etblocks.export.speculate import MAX_LOOKUP_PAUSE, accept, check_max_draft, lookup_drafter, prompt_lookup

CONTEXT = 160
VARIANTS = {"mistral_int8kv": ("mistral", dict(kv_quantize="int8"))}  # program name -> (family, swap options)


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """Dynamic XNNPACK programs with `verify`, exported once per family: `programs(name) -> (name, original,
    ExportResult)`."""
    exported = {}

    def program(name: str):
        if name not in exported:
            family, options = VARIANTS.get(name, (name, {}))
            original, swapped = swapped_family(family, "xnnpack", max_seq_len=CONTEXT, **options)
            out = tmp_path_factory.mktemp("speculation") / f"{name}.pte"
            exported[name] = name, original, etblocks.export(swapped, backend="xnnpack", out=out, max_draft=MAX_DRAFT)
        return exported[name]

    return program


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    """Draft programs for the llama target, by name: `smaller` (one layer, other weights; dynamic, exported with
    max_draft), `smaller_static` (the same as a static portable program with caller-owned state). The draft with the
    target's own weights ("same") is the target's program itself, loaded a second time."""
    out = tmp_path_factory.mktemp("drafts")
    paths = {}
    for name, seed, layers, options in [("smaller", 7, 1, {}), ("smaller_static", 7, 1, dict(shapes="static", chunk=8))]:
        model = tiny_model("llama", seed=seed, num_hidden_layers=layers)
        backend = "portable" if options else "xnnpack"
        etblocks.swap(model, backend=backend, max_seq_len=CONTEXT, **options)
        export_options = {} if options else dict(max_draft=MAX_DRAFT)
        paths[name] = etblocks.export(model, backend=backend, out=out / f"{name}.pte", **export_options).path
    return paths


@pytest.fixture(params=["llama", "mistral", "deepseek_v2", "mistral_int8kv"])
def dynamic(request, programs):
    """Full attention (llama), sliding-window attention over ring caches (mistral, window 6: every prompt wraps the
    ring), latent attention (MLA, deepseek_v2), and int8 rings (mistral with `kv_quantize="int8"`)."""
    return programs(request.param)


@pytest.mark.slow
def test_dynamic_program_speculates_to_hf_generate(dynamic):
    name, original, result = dynamic
    assert "verify" in result.methods and result.metadata["get_max_verify_len"] == MAX_DRAFT + 1
    # int8 caches round K/V unlike HF: there speculation must leave the program's own greedy tokens unchanged
    check_greedy_with_speculation(etblocks.Runner(result.path), None if "int8" in name else original, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "mistral", "deepseek_v2"])
def test_score_is_transformers_log_probs(programs, name):
    """`Runner.score` in `verify` calls of MAX_DRAFT + 1 tokens (full attention, rings that wrap, latent caches):
    transformers' log-probabilities; `perplexity` over windows is the exponent of their negated mean."""
    _, original, result = programs(name)
    runner = etblocks.Runner(result.path)
    ids = prompt_ids(40, seed=3)[0].tolist()
    expected = hf_log_probs(original, ids)
    torch.testing.assert_close(runner.score(ids), expected, rtol=0, atol=SCORE_ATOL)
    windows = torch.cat([hf_log_probs(original, ids[:20]), hf_log_probs(original, ids[20:])])
    assert runner.perplexity(ids, window=20).value == pytest.approx(float((-windows.double().mean()).exp()), rel=1e-4)
    assert runner.pos == 0  # left reset


def test_rings_get_spare_slots_for_rejected_rows():
    """A verify program's rings hold the window plus `max_draft` slots (what keeps rejected rows from overwriting
    rows still in the window); the attention window itself is unchanged."""
    from etblocks.export.programs import verify_program
    from etblocks.state.ring import RingKVCache

    _, swapped = swapped_family("mistral", "xnnpack", max_seq_len=CONTEXT)
    verify_program(swapped, MAX_DRAFT)
    rings = [m for m in swapped.modules() if isinstance(m, RingKVCache)]
    assert rings and all(ring.window == WINDOW + MAX_DRAFT and ring.k_cache.shape[1] == WINDOW + MAX_DRAFT for ring in rings)
    assert all(layer.self_attn.sdpa.sliding_window == WINDOW for layer in swapped.model.layers)


@pytest.mark.slow
def test_continuation_after_speculation_is_hf_generate(dynamic):
    """A speculative reply leaves the program where plain decoding would: the next turn (fresh=False) equals HF
    generate over the whole conversation."""
    name, original, result = dynamic
    runner = etblocks.Runner(result.path)
    first = PROMPTS["repeating"]
    reply = runner.generate(first, 12, speculate="prompt_lookup")
    second = prompt_ids(6, seed=2)[0].tolist()
    continued = runner.generate(second, 8, fresh=False, speculate="prompt_lookup")
    assert continued == hf_greedy(original, torch.tensor([first + reply + second]), 8), name


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["same", "smaller", "smaller_static"])
def test_draft_model_speculation_is_hf_generate(programs, drafts, draft):
    """A draft program proposes; the target keeps what it agrees with. Greedy output is HF generate's whether the
    draft is always right (the target's own weights), mostly wrong (a dynamic one-layer model, which drops its
    rejected tokens by moving its position back) or a static program (which goes back to its saved state)."""
    _, original, result = programs("llama")
    runner = etblocks.Runner(result.path)
    draft_runner = etblocks.Runner(result.path if draft == "same" else drafts[draft])  # same: a second copy of it
    for kind, prompt in PROMPTS.items():
        expected = hf_greedy(original, torch.tensor([prompt]), NEW_TOKENS)
        assert runner.generate(prompt, NEW_TOKENS, speculate=draft_runner) == expected, (draft, kind)
        stats = runner.last_speculation
        assert stats.drafted > 0, (draft, kind)
        if draft == "same":
            assert stats.accepted == stats.drafted and stats.tokens_per_call > MAX_DRAFT, (kind, stats)
        else:
            assert stats.accepted < stats.drafted, (draft, kind, stats)


def swapped_draft(seed: int = 7, layers: int = 1, context: int = CONTEXT, **overrides) -> torch.nn.Module:
    """A llama (by default one layer with other weights than the target's) swapped for dynamic XNNPACK programs."""
    draft = tiny_model("llama", seed=seed, num_hidden_layers=layers, **overrides)
    return etblocks.swap(draft, backend="xnnpack", max_seq_len=context)


@pytest.mark.slow
def test_draft_model_in_the_targets_file_is_hf_generate(drafts, tmp_path):
    """`export(..., draft=)` puts the draft's forward and verify in the target's file, its weights and state under
    their own names. speculate="draft" gives HF generate's tokens and proposes, accepts and rejects exactly what the
    same draft in a file of its own does (`test_draft_model_speculation_is_hf_generate` checks that one against HF):
    a one-layer model of other weights, whose layer-0 caches have the target's shapes (were they one buffer, the
    target's tokens would change). The target's plain forward is untouched."""
    original, target = swapped_family("llama", "xnnpack", max_seq_len=CONTEXT)
    result = etblocks.export(target, backend="xnnpack", out=tmp_path / "both.pte", max_draft=MAX_DRAFT,
                             draft=swapped_draft())
    assert {"forward", "verify", "draft_forward", "draft_verify", "draft_get_max_verify_len"} <= set(result.methods)
    runner = etblocks.Runner(result.path)
    assert runner.draft is not None and runner.draft.vocab_size == VOCAB
    separate = etblocks.Runner(drafts["smaller"])  # the same model in a file of its own
    for kind, prompt in PROMPTS.items():
        expected = hf_greedy(original, torch.tensor([prompt]), NEW_TOKENS)
        assert runner.generate(prompt, NEW_TOKENS) == expected, kind
        assert runner.generate(prompt, NEW_TOKENS, speculate="draft") == expected, kind
        embedded = runner.last_speculation
        assert embedded.drafted > 0 and embedded.accepted < embedded.drafted, (kind, embedded)
        assert runner.generate(prompt, NEW_TOKENS, speculate=separate) == expected, kind
        assert runner.last_speculation == embedded, kind


@pytest.mark.slow
def test_export_refuses_a_draft_it_cannot_hold(programs, tmp_path):
    """Before any work, naming what is wrong: a draft without max_draft, the model itself, with another vocabulary,
    with a shorter context, static shapes or LoRA adapters; speculate="draft" on a file without one."""
    from peft_refs import make_adapter

    _, target = swapped_family("llama", "xnnpack", max_seq_len=CONTEXT)
    out = tmp_path / "both.pte"
    with pytest.raises(ConfigError, match="draft= needs max_draft=N"):
        etblocks.export(target, backend="xnnpack", out=out, draft=swapped_draft())
    with pytest.raises(ConfigError, match="draft= is the model being exported"):
        etblocks.export(target, backend="xnnpack", out=out, max_draft=MAX_DRAFT, draft=target)
    adapted = tiny_model("llama", seed=7, num_hidden_layers=1)
    make_adapter(adapted, tmp_path / "adapter", seed=0, r=2, target_modules=["q_proj"])
    etblocks.swap(adapted, backend="xnnpack", max_seq_len=CONTEXT)
    etblocks.load_adapter(adapted, tmp_path / "adapter", name="a")
    with pytest.raises(ConfigError, match="draft= holds LoRA adapters"):
        etblocks.export(target, backend="xnnpack", out=out, max_draft=MAX_DRAFT, draft=adapted)
    with pytest.raises(ConfigError, match=f"draft= has a vocabulary of {VOCAB + 1} tokens, the model {VOCAB}"):
        etblocks.export(target, backend="xnnpack", out=out, max_draft=MAX_DRAFT, draft=swapped_draft(vocab_size=VOCAB + 1))
    with pytest.raises(ConfigError, match=f"draft= was swapped for max_seq_len=64, the program holds {CONTEXT}"):
        etblocks.export(target, backend="xnnpack", out=out, max_draft=MAX_DRAFT, draft=swapped_draft(context=64))
    static = etblocks.swap(tiny_model("llama", num_hidden_layers=1), backend="xnnpack", max_seq_len=CONTEXT,
                           shapes="static", chunk=8)
    with pytest.raises(ConfigError, match="draft=: max_draft=4 is for dynamic programs"):
        etblocks.export(target, backend="xnnpack", out=out, max_draft=MAX_DRAFT, draft=static)
    assert not out.exists()
    _, _, result = programs("llama")
    with pytest.raises(ConfigError, match="speculate='draft' needs a draft model in the program's file"):
        etblocks.Runner(result.path).generate([5, 6, 7], 4, speculate="draft")


@pytest.mark.slow
def test_draft_model_that_cannot_follow_is_refused(programs, tmp_path):
    """A dynamic draft without `verify` could not drop rejected tokens; a draft is not the target itself."""
    _, _, result = programs("llama")
    runner = etblocks.Runner(result.path)
    _, plain = swapped_family("llama", "xnnpack", max_seq_len=CONTEXT)
    draft = etblocks.Runner(etblocks.export(plain, backend="xnnpack", out=tmp_path / "plain.pte").path)
    with pytest.raises(ConfigError, match="exported without max_draft"):
        runner.generate([5, 6, 7], 4, speculate=draft)
    with pytest.raises(ConfigError, match="is this Runner itself"):
        runner.generate([5, 6, 7], 4, speculate=runner)


@pytest.mark.slow
@pytest.mark.parametrize("proposal", ["likeliest", "draft"])
def test_speculative_sampling_keeps_the_programs_distribution(programs, drafts, proposal):
    """The first two sampled tokens (temperature 1, top_p 0.9), drawn 3000 times, the second checked against a
    proposal (the likeliest token after the first, or a draft program's sample): each token's frequency at each step is within 5 sigma of the program's own distribution,
    computed exactly from its logits (the second token's marginal over every first token)."""
    from etblocks.export.sampling import distribution

    _, _, result = programs("llama")

    runner = etblocks.Runner(result.path)
    prompt, temperature, top_p = PROMPTS["random"], 1.0, 0.9
    runner.reset()
    first = distribution(runner.forward(prompt), temperature, top_p)
    second, best_after = numpy.zeros(VOCAB), {}
    for token in numpy.flatnonzero(first):
        runner.reset()
        runner.forward(prompt)
        after = distribution(runner.forward([int(token)]), temperature, top_p)
        second += first[token] * after
        best_after[int(token)] = int(numpy.argmax(after))

    def likeliest(history, limit):  # the likeliest token after the first: kept often, rejected often
        return [best_after[history[-1]]][:limit]

    propose = likeliest if proposal == "likeliest" else etblocks.Runner(drafts["smaller"])

    draws, counts, kept, proposed = 3000, numpy.zeros((2, VOCAB)), 0, 0
    for seed in range(draws):
        tokens = runner.generate(prompt, 2, temperature=temperature, top_p=top_p, seed=seed, speculate=propose)
        counts[0, tokens[0]] += 1
        counts[1, tokens[1]] += 1
        kept += runner.last_speculation.accepted
        proposed += runner.last_speculation.drafted
    assert 0.02 < kept / proposed < 0.95, (kept, proposed)
    for step, expected in enumerate((first, second)):
        frequencies = counts[step] / draws
        sigma = numpy.sqrt(expected * (1 - expected) / draws)
        assert (numpy.abs(frequencies - expected) <= 5 * sigma + 1e-3).all(), (step, frequencies, expected)
        assert (counts[step][expected == 0] == 0).all(), "a token outside the nucleus was drawn"


def test_acceptance_rule_keeps_the_distribution():
    """`accept` alone, without a program: the token it yields after a deterministic proposal, and after a
    proposal drawn from another distribution q, is distributed as the target p (20000 draws, 5 sigma)."""
    from etblocks.export.sampling import distribution

    logits = torch.randn(2, 12, generator=torch.Generator().manual_seed(0)) * 2
    p = distribution(logits[0], 1.0, 1.0)
    q = distribution(torch.randn(12, generator=torch.Generator().manual_seed(1)), 1.0, 1.0)
    generator, draws = torch.Generator().manual_seed(2), 20000
    rng = numpy.random.default_rng(3)
    for draft_probs in (None, q):
        counts = numpy.zeros(12)
        for _ in range(draws):
            token = 4 if draft_probs is None else int(rng.choice(12, p=q / q.sum()))
            counts[accept(logits, [token], 1.0, 1.0, generator, None if draft_probs is None else [q])[0]] += 1
        sigma = numpy.sqrt(p * (1 - p) / draws)
        assert (numpy.abs(counts / draws - p) <= 5 * sigma + 1e-4).all(), (draft_probs is None, counts / draws, p)


def test_greedy_acceptance_keeps_the_agreeing_prefix():
    logits = torch.full((4, 10), -1.0)
    for row, best in enumerate([3, 5, 7, 9]):
        logits[row, best] = 1.0
    assert accept(logits, [3, 5, 7], 0.0, 1.0, None) == [3, 5, 7, 9]  # all kept, plus the next token
    assert accept(logits, [3, 6, 7], 0.0, 1.0, None) == [3, 5]  # the program's own token at the first rejection
    assert accept(logits, [4, 5, 7], 0.0, 1.0, None) == [3]


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    assert prompt_lookup([1, 2, 3, 4, 1, 2, 3, 9, 9, 1, 2], 4) == [3, 9, 9, 1]  # "1 2" last seen before "3 9 9 1"
    assert prompt_lookup([7, 8, 9, 1, 7, 8, 5, 8], 2) == [5, 8]  # no 3- or 2-gram match: the 1-gram "8"
    assert prompt_lookup([5, 6, 7], 3) == []
    assert prompt_lookup([4, 4], 3) == [4]


def test_prompt_lookup_is_its_definition_on_random_sequences():
    """Against the definition written out: for n = 3, 2, 1, the latest start i with history[i:i+n] equal to the last
    n tokens and a token after it; the tokens from i + n."""

    def defined(history: list[int], limit: int) -> list[int]:
        for n in range(min(3, len(history) - 1), 0, -1):
            starts = [i for i in range(len(history) - n) if history[i : i + n] == history[-n:]]
            if starts:
                return history[starts[-1] + n : starts[-1] + n + limit]
        return []

    generator = numpy.random.default_rng(0)
    for _ in range(2000):
        history = generator.integers(0, 4, size=int(generator.integers(1, 40))).tolist()
        limit = int(generator.integers(1, 6))
        assert prompt_lookup(history, limit) == defined(history, limit), history


def asked_steps(drafter, steps: int, kept_at: dict[int, int]) -> list[int]:
    """The steps at which `drafter` asks its proposer, driven as the runner drives it: a proposal each step, and
    `kept(n)` after each non-empty one (`kept_at[step]` tokens, else none)."""
    asked = []
    drafter.start([1, 2, 3])
    for step in range(steps):
        draft, _ = drafter.propose([1, 2, 3], 4)
        if draft:
            asked.append(step)
            drafter.kept(kept_at.get(step, 0))
    return asked


def test_lookup_backs_off_after_proposals_with_nothing_kept():
    """All-wrong proposals: pauses of 1, 2, 4, 8 steps, then 16 (the cap) for good; a proposal with a token kept
    ends the back-off; a new generation starts without one."""
    assert MAX_LOOKUP_PAUSE == 16
    drafter = lookup_drafter(lambda history, limit: [9] * limit)
    assert asked_steps(drafter, 80, {}) == [0, 2, 5, 10, 19, 36, 53, 70]
    # kept at step 2: the next miss (step 3) pauses 1 step again, not 4
    assert asked_steps(drafter, 12, {2: 1}) == [0, 2, 3, 5, 8]
    assert asked_steps(drafter, 3, {}) == [0, 2]  # start() forgot the last run's pause
    nothing = lookup_drafter(lambda history, limit: [])
    assert asked_steps(nothing, 5, {}) == []


def test_bad_speculation_options_are_refused():
    with pytest.raises(ConfigError, match="speculate='ngram'"):
        lookup_drafter("ngram")
    with pytest.raises(ConfigError, match="max_draft=0"):
        check_max_draft(0)


@pytest.mark.slow
def test_export_refuses_verify_where_rollback_would_be_wrong(tmp_path):
    """A dynamic program whose convolution or recurrent state a rejected token would change gets no verify method:
    the export says which state and what to do, before any work; a static program needs none."""
    _, hybrid = swapped_family("lfm2", "xnnpack", max_seq_len=CONTEXT)
    with pytest.raises(ConfigError, match=r"max_draft=4: .*\(WindowState\) keeps window state.*shapes='static'"):
        etblocks.export(hybrid, backend="xnnpack", out=tmp_path / "hybrid.pte", max_draft=4)
    _, static = swapped_family("llama", "xnnpack", max_seq_len=CONTEXT, shapes="static", chunk=8)
    with pytest.raises(ConfigError, match="checks proposed tokens with its prefill"):
        etblocks.export(static, backend="xnnpack", out=tmp_path / "static.pte", max_draft=4)
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_runner_refuses_speculation_without_a_verify_method(tmp_path):
    _, swapped = swapped_family("llama", "xnnpack", max_seq_len=CONTEXT)
    result = etblocks.export(swapped, backend="xnnpack", out=tmp_path / "plain.pte")
    runner = etblocks.Runner(result.path)
    with pytest.raises(ConfigError, match="export a dynamic program with max_draft=N"):
        runner.generate([5, 6, 7], 4, speculate="prompt_lookup")
