"""`pdserve train-mtp`: train an MTP head for a model by self-distillation.

    pdserve train-mtp --out engine/mtp_heads/smollm2-135m-instruct.safetensors
    pdserve train-mtp --device cuda --model /tmp/smollm2.gguf --out /tmp/head.safetensors

The recipe needs no data set and no downloads:
  1. prompts: its own templates x topics plus generated tasks (arithmetic, code, writing),
     wrapped in the model's chat template; a separate set of templates and topics
     (heldout_prompts) is never trained on and measures acceptance;
  2. continuations: the model answers them through our engine, many sequences at once
     (CUDA: Triton kernels, CUDA-graph decode steps, 512 sequences in flight, refilled in
     waves so most steps are pure decode steps); the first pass over the distinct prompts
     is mostly greedy (what verification compares drafts against), the rest sampled at
     temperature 0.6-0.9 for variety. CUDA runs are time-budgeted (--gen-time-s): as many
     sequences as fit; sequences cut by the budget keep what they have;
  3. teacher signal: while generating, the engine's own forward passes are recorded: the
     target's normed hidden state h[t] at every position, and its top-K next-token
     distribution there (lm_head over h[t]);
  4. training: the head reads (h[t], token[t+1]) at position t and learns the target's
     distribution at t+1 (i.e. of token t+2): soft cross-entropy against the target's top-K
     distribution plus (--hard-weight) cross-entropy on its argmax, the token greedy
     verification accepts. Embeddings and lm_head are the target's and stay frozen; enorm,
     hnorm, eh_proj, the decoder block and the final norm train (the final norm starts as
     the target's, --init last-layer also starts the block as the target's last layer).
     Optional chain loss: a second step from the head's own output (what drafts 2..k see),
     and (--feature-weight) a pull of the head's output towards the target's hidden state
     at t+1 (EAGLE's feature loss: drafts 2..k then read an in-distribution state). AdamW,
     warm-up then cosine decay, bf16 autocast on CUDA, batches grouped by length; a slice of
     the corpus is held out for top-1 agreement curves. On CPU the softmax runs over a
     vocabulary subset (the batch's candidate tokens).
  5. evaluation: first-draft acceptance at k=1 and mean accepted length at k=3 on the
     held-out prompts, through the engine's spec-decode counters.
Outputs: the head (safetensors, fp16), <out>.json (settings, timings, losses, top-1 curves,
acceptance) and a loss curve <out>.png (matplotlib, or a plain plot without it). CPU works
(small defaults); CUDA runs the same recipe at a larger size within --deadline-s.

The recipe lives in submodules: prompts (1: templates, topics, tasks, chat templating),
corpus (2-3: generation engine, hidden-state recorder, teacher top-K), training (4),
evaluation (5: acceptance), plots (loss curve PNG), cli (flags and the run). This package
re-exports their public names, so `from pdserve.engine.train_mtp import ...` and `add_parser`
(used by router/cli.py) work.
"""
from __future__ import annotations

from pdserve.engine.train_mtp.cli import DEFAULTS, add_parser
from pdserve.engine.train_mtp.corpus import (
    HiddenRecorder,
    PaddedDecodeBackend,
    Sample,
    generate_corpus,
    generation_engine,
)
from pdserve.engine.train_mtp.evaluation import measure_acceptance
from pdserve.engine.train_mtp.plots import plot_losses
from pdserve.engine.train_mtp.prompts import (
    HELDOUT_TEMPLATES,
    HELDOUT_TOPICS,
    TRAIN_TEMPLATES,
    TRAIN_TOPICS,
    ChatPrompts,
    chat,
    chat_text,
    corpus_prompts,
    heldout_prompts,
    task_prompts,
    temperature_for,
    training_prompts,
)
from pdserve.engine.train_mtp.training import (
    INITS,
    DenseCausalBackend,
    batch_loss,
    evaluate_top1,
    init_head,
    train_head,
)

__all__ = [
    "DEFAULTS", "HELDOUT_TEMPLATES", "HELDOUT_TOPICS", "INITS", "TRAIN_TEMPLATES",
    "TRAIN_TOPICS", "ChatPrompts", "DenseCausalBackend", "HiddenRecorder",
    "PaddedDecodeBackend", "Sample", "add_parser", "batch_loss", "chat", "chat_text",
    "corpus_prompts", "evaluate_top1", "generate_corpus", "generation_engine",
    "heldout_prompts", "init_head", "measure_acceptance", "plot_losses", "task_prompts",
    "temperature_for", "train_head", "training_prompts",
]
