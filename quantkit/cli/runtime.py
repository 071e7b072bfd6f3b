"""`quantkit generate|chat|roofline`: quantkit's runtime, and the decode ceiling of a GPU by arithmetic."""
from __future__ import annotations

import json
import sys

import click

from quantkit.cli import (
    device_option,
    emit,
    friendly_errors,
    json_option,
    revision_option,
    seed_option,
    sparse_config_option,
    sparse_option,
    stack,
)
from quantkit.table import format_table


def _draft_tokens(ctx, param, value: str) -> int | str:
    if value == "auto":
        return value
    if not value.isdigit() or int(value) < 1:
        raise click.ClickException(f"--draft-tokens must be a count of at least 1, or auto; got {value!r}")
    return int(value)


# Options shared by `generate` and `chat`: the runtime and the sampler.
runtime_options = stack(
    click.option("--model", default="default", show_default=True,
                 help="Any checkpoint quantkit reads: unquantized, or an artifact it wrote."),
    revision_option("--model"),
    sparse_option,
    sparse_config_option,
    device_option,
    click.option("--max-new-tokens", default=256, show_default=True, type=int),
    click.option("--temperature", default=0.0, show_default=True, type=float, help="0 is greedy."),
    click.option("--top-p", default=1.0, show_default=True, type=float),
    seed_option("the sampler (temperature > 0)"),
    click.option("--prefill-chunk", default=512, show_default=True, type=int,
                 help="Prompt tokens per forward pass (bounds activation memory on long prompts)."),
    click.option("--thinking/--no-thinking", default=False, show_default=True,
                 help="MiniCPM4.1's hybrid reasoning (chat template enable_thinking)."),
    click.option("--draft", default=None,
                 help="Decode speculatively with this draft: an EAGLE-3 head, or a model with the same tokenizer."),
    click.option("--draft-tokens", default="3", show_default=True, callback=_draft_tokens, metavar="N|auto",
                 help="Draft tokens verified per target forward (with --draft); auto: each round the chain "
                      "length (0-5) expected to commit the most tokens a second, from this machine's timings "
                      "and the acceptance so far."),
    click.option("--draft-tree", default=None, metavar="DEPTHxTOPKxSIZE",
                 help="Draft EAGLE-2 trees of this shape instead of chains (with --draft), e.g. 3x4x12; "
                      "sampled trees keep the target's distribution (recursive rejection sampling)."),
    click.option("--draft-window", default=None, type=click.IntRange(min=1),
                 help="An EAGLE-3 head attends only the last N positions (CPM.cu uses 1024 in long contexts)."),
)


def runtime_from_options(model, revision, sparse, sparse_config, device, prefill_chunk, draft=None,
                         draft_tokens=3, draft_tree=None, draft_window=None):
    """The runtime for the command line's model options: MODEL (and a DRAFT) resolved, --sparse-config parsed.
    The model's tokenizer starts in a process of its own before torch is imported here, so that the two
    load side by side (kernels/tokenizer_process.py)."""
    from quantkit.kernels.tokenizer_process import TokenizerProcess
    from quantkit.zoo import resolve_model

    overrides = None
    if sparse_config:
        try:
            overrides = json.loads(sparse_config)
        except json.JSONDecodeError as e:
            raise click.ClickException(f"--sparse-config is not valid JSON: {e}") from e
    model_dir = resolve_model(model, revision=revision)
    tokenizer = TokenizerProcess.start(model_dir)

    from quantkit.kernels.generate import load_text_generator
    from quantkit.kernels.speculative import TreeShape

    return load_text_generator(model_dir, sparse=sparse, sparse_overrides=overrides, device=device,
                               prefill_chunk=prefill_chunk, draft=None if draft is None else resolve_model(draft),
                               draft_tokens=draft_tokens,
                               draft_tree=None if draft_tree is None else TreeShape.parse(draft_tree),
                               draft_window=draft_window, tokenizer=tokenizer)


@click.command()
@click.option("--prompt", required=True, help="The text to continue, or the user message with --chat.")
@click.option("--chat/--raw", default=True, show_default=True, help="Wrap the prompt in the chat template.")
@runtime_options
@json_option
@friendly_errors
def generate(prompt, chat, model, revision, sparse, sparse_config, device, max_new_tokens, temperature, top_p, seed,
             prefill_chunk, thinking, draft, draft_tokens, draft_tree, draft_window, as_json):
    """Generate text with quantkit's runtime, streaming it as it is decoded."""
    generator = runtime_from_options(model, revision, sparse, sparse_config, device, prefill_chunk, draft,
                                     draft_tokens, draft_tree, draft_window)  # first: it starts the tokenizer
    from quantkit.kernels.generate import CONTEXT_LIMIT
    from quantkit.kernels.sampling import Sampling

    ids = (generator.chat_prompt([{"role": "user", "content": prompt}], enable_thinking=thinking) if chat
           else generator.encode(prompt))
    settings = dict(max_new_tokens=max_new_tokens, sampling=Sampling(temperature, top_p, seed))
    if as_json:
        result = generator.generate(ids, **settings)
        emit(True, {"text": result.text, "tokens": result.tokens, "prompt_tokens": result.prompt_tokens,
                     "stop_reason": result.stop_reason,
                     "prefill_tokens_per_second": result.prefill_tokens_per_second,
                     "decode_tokens_per_second": result.decode_tokens_per_second,
                     "speculative": result.acceptance}, "")
        return
    timings: dict = {}
    for piece in generator.stream(ids, timings=timings, **settings):
        click.echo(piece, nl=False)
    click.echo()
    speculative = (f"; tau {timings['acceptance'].tau:.2f} over {timings['acceptance'].rounds} rounds"
                   if "acceptance" in timings else "")
    if "chain_lengths" in timings:
        speculative += "; rounds per chain length " + ", ".join(
            f"{length}: {count}" for length, count in sorted(timings["chain_lengths"].items()))
    reason = timings["stop_reason"]
    if reason == CONTEXT_LIMIT:
        reason += f" ({generator.context} tokens, max_position_embeddings)"
    click.echo(f"[{len(ids)} prompt tokens in {timings['prefill_seconds']:.2f} s; stopped on "
               f"{reason}; decode {timings['decode_seconds']:.2f} s{speculative}]", err=True)


@click.command()
@runtime_options
@friendly_errors
def chat(model, revision, sparse, sparse_config, device, max_new_tokens, temperature, top_p, seed, prefill_chunk,
         thinking, draft, draft_tokens, draft_tree, draft_window):
    """Interactive chat. The KV cache is kept between turns: each turn prefills only the new tokens.
    Type /reset to start over, /exit (or Ctrl-D) to leave."""
    generator = runtime_from_options(model, revision, sparse, sparse_config, device, prefill_chunk, draft,
                                     draft_tokens, draft_tree, draft_window)  # first: it starts the tokenizer
    from quantkit.kernels.chat import ChatSession
    from quantkit.kernels.generate import PromptError
    from quantkit.kernels.sampling import Sampling

    session = ChatSession(generator, enable_thinking=thinking)
    settings = dict(max_new_tokens=max_new_tokens, sampling=Sampling(temperature, top_p, seed))
    # Bytes that are not UTF-8 arrive as lone surrogates, which the session refuses in one line and goes on,
    # rather than a decoding error that would end the conversation.
    sys.stdin.reconfigure(errors="surrogateescape")
    while True:
        try:
            line = click.prompt("you", prompt_suffix="> ")
        except (EOFError, click.Abort):
            break
        if line.strip() == "/exit":
            break
        if line.strip() == "/reset":
            session.reset()
            continue
        answering = False
        try:
            reply = session.reply(line, **settings)
            click.echo("model> ", nl=False)
            answering = True
            for piece in reply:
                click.echo(piece, nl=False)
        except PromptError as e:  # this message is refused; the conversation goes on
            click.echo(nl=answering)
            click.echo(f"Error: {e}", err=True)
            continue
        click.echo()


@click.command()
@click.option("--hardware", type=click.Choice(["rtx4090", "orin"]), required=True,
              help="The GPU whose peak memory bandwidth bounds the decode and whose dense tensor-core peak bounds "
                   "the prefill.")
@click.option("--model", default="default", show_default=True, help="Checkpoint or quantized artifact.")
@revision_option("--model")
@click.option("--context", "contexts", multiple=True, type=int, default=(4096,), show_default=True,
              help="Tokens already in the KV cache for the decode, and prompt tokens for the prefill (repeat for "
                   "several).")
@sparse_option
@json_option
@friendly_errors
def roofline(hardware, model, revision, contexts, sparse, as_json):
    """Decode and prefill ceilings on a GPU. Decode: (weight + KV bytes per token) / peak bandwidth. Prefill:
    operations per token over the dense tensor-core peak of the artifact's math (int8 or fp8 for W8A8, else
    bf16). Arithmetic, not a measurement: no GPU exists where quantkit is tested."""
    from quantkit.kernels.attention import sparse_config_for
    from quantkit.kernels.roofline import HARDWARE, RUNTIME_MATH
    from quantkit.kernels.roofline import roofline as ceiling
    from quantkit.models import MiniCPMConfig
    from quantkit.zoo import resolve_model

    model_dir = resolve_model(model, revision=revision)
    sparse_settings = sparse_config_for(sparse, MiniCPMConfig.from_pretrained(model_dir).sparse_attention)
    results = [ceiling(model_dir, hardware, context, sparse_settings) for context in contexts]
    rows = [[r.context, r.attention, r.weight_bytes / 1e6, r.kv_bytes / 1e6, r.decode_tokens_per_second_ceiling,
             r.math, r.ops_per_token / 1e9,
             "n/a" if r.prefill_tokens_per_second_ceiling is None else r.prefill_tokens_per_second_ceiling,
             "yes" if r.fits_in_memory else "NO"] for r in results]
    spec = HARDWARE[hardware]
    math = results[0].math
    peaks = ", ".join(f"{name} {peak.tera_ops:g}" for name, peak in spec.tensor_peaks.items()
                      if name in (math, RUNTIME_MATH))
    notes = sorted({r.prefill_note for r in results if r.prefill_note})
    text = (f"{spec.name}, {spec.memory_bandwidth_gb_s:g} GB/s peak ({spec.source}); dense tensor-core peak "
            f"T(FL)OPS: {peaks or 'none'}\n"
            + format_table(["context", "attention", "weights MB", "KV read MB", "decode tok/s ceiling", "math",
                            "prefill GOP/token", "prefill tok/s ceiling", "fits"], rows)
            + "".join(f"\n{note}" for note in notes)
            + "\n\nArithmetic, not measured: decode, bytes read per decoded token over peak memory bandwidth; "
              f"prefill of `context` tokens, the linears' operations at the {math} peak and the LM head's (last "
              f"position only) and attention's at the {RUNTIME_MATH} peak.")
    emit(as_json, {"hardware": hardware, "model": str(model_dir),
                   "tensor_peaks": {name: {"tera_ops": peak.tera_ops, "source": peak.source}
                                    for name, peak in spec.tensor_peaks.items()},
                   "results": [r.to_dict() for r in results]}, text)
