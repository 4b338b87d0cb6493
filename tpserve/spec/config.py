"""Speculative-decoding settings, checked once at start-up with messages naming the flag."""

from __future__ import annotations

from dataclasses import dataclass

from tpserve.args import ServerArgs
from tpserve.errors import ConfigError
from tpserve.models.config import ModelConfig
from tpserve.models.eagle3 import Eagle3Config


@dataclass(frozen=True)
class SpecConfig:
    num_steps: int  # draft depth
    topk: int  # branching per draft step
    num_draft_tokens: int  # tree nodes verified per step, root included

    @property
    def num_candidates(self) -> int:
        """Nodes the drafting loop proposes: topk at depth 1, topk^2 per later step."""
        return self.topk + (self.num_steps - 1) * self.topk * self.topk

    @property
    def lookahead(self) -> int:
        """KV slots past the root a step writes (verify nodes or temporary draft nodes)."""
        return max(self.num_draft_tokens, (self.num_steps - 1) * self.topk)

    @property
    def reserve(self) -> int:
        """KV slots past the root the scheduler keeps each decoding request ahead of its
        sequence: this step's lookahead plus the most it can accept (``num_steps``), so the
        next step's tree and verify fall in pages the request already holds. The drafting
        follower grows the next tree before rank 0's plan says which page a request gets
        next (``Drafter.run_ahead``); with only this step's lookahead reserved, ~9% of the
        demo pair's batch-1 steps crossed into a page not yet allocated and drafted after
        the plan instead, and ~28% rebuilt the verify layout for a newly added page."""
        return self.lookahead + self.num_steps


def spec_config_from_args(args: ServerArgs) -> SpecConfig | None:
    algo = args.speculative_algorithm
    if algo is None or str(algo).lower() in ("", "none"):
        return None
    if str(algo).upper() not in ("EAGLE3", "EAGLE-3"):
        raise ConfigError(f"--speculative-algorithm '{algo}' is not supported (use EAGLE3)",
                          "--speculative-algorithm")
    if not args.speculative_draft_model_path:
        raise ConfigError("--speculative-algorithm EAGLE3 needs --speculative-draft-model-path",
                          "--speculative-draft-model-path")
    cfg = SpecConfig(args.speculative_num_steps, args.speculative_eagle_topk,
                     args.speculative_num_draft_tokens)
    check_tree_shape(cfg)
    return cfg


def check_tree_shape(cfg: SpecConfig) -> None:
    steps, k, n = cfg.num_steps, cfg.topk, cfg.num_draft_tokens
    if steps < 1 or k < 1 or n < 2:
        raise ConfigError("--speculative-num-steps and --speculative-eagle-topk must be >= 1 and "
                          "--speculative-num-draft-tokens >= 2", "--speculative-num-steps")
    if k == 1 and n != steps + 1:
        raise ConfigError(f"with --speculative-eagle-topk 1 the draft is a chain: "
                          f"--speculative-num-draft-tokens must be num_steps + 1 = {steps + 1}, "
                          f"got {n}", "--speculative-num-draft-tokens")
    full_tree = 1 + sum(k**i for i in range(1, steps + 1))
    if n > full_tree:
        raise ConfigError(f"--speculative-num-draft-tokens {n} exceeds the {full_tree} nodes of "
                          f"a depth-{steps}, topk-{k} tree", "--speculative-num-draft-tokens")
    if n - 1 > cfg.num_candidates:
        raise ConfigError(f"--speculative-num-draft-tokens {n} needs more than the "
                          f"{cfg.num_candidates} candidates that {steps} steps of topk {k} "
                          "propose; raise --speculative-num-steps or --speculative-eagle-topk",
                          "--speculative-num-draft-tokens")


def check_draft_matches(draft: Eagle3Config, target: ModelConfig) -> None:
    if draft.target_hidden_size != target.hidden_size:
        raise ConfigError(f"the draft expects target hidden size {draft.target_hidden_size}, "
                          f"but the target has {target.hidden_size}",
                          "--speculative-draft-model-path")
    if draft.base.vocab_size != target.vocab_size:
        raise ConfigError(f"the draft's vocab_size {draft.base.vocab_size} differs from the "
                          f"target's {target.vocab_size}", "--speculative-draft-model-path")
    if draft.base.hidden_size != target.hidden_size:
        # Embeddings are shared with the target, so the draft width must equal the target's.
        raise ConfigError(f"draft hidden size {draft.base.hidden_size} differs from the "
                          f"target's {target.hidden_size} (embeddings are shared)",
                          "--speculative-draft-model-path")
