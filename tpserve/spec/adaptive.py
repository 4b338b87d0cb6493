"""Adaptive speculation: per engine step, the setting with the highest predicted tok/s.

Rank 0 owns the chooser; its choice reaches every rank as an ordinary ``ConfigChange``
between two steps, so ranks never decide from timings they measured themselves.

What is measured live, per batch-size bucket (powers of two) and setting: step time, the
target forward inside it (decode or verify) and the draft phase (not in the first step
after a switch, which pays for the switch); and, per bucket and
branching factor, how often the draft is accepted at each depth. ``CostModel`` (the A/B harness's model) turns
those into a prediction for settings not measured at a bucket yet: draft cost per depth, a
verify line through the measured node counts (plain decode is the 1-node point), and the
acceptance measured at that bucket, continued geometrically past the deepest depth seen.

Four rules keep it honest and calm:
- settings are compared on the same text: the tokens per request of every speculative
  setting move with every speculative step, whichever runs (a tree's first branch is what
  each chain would have accepted; while a chain runs, a tree follows it along a line fitted
  over the tree's own steps), so no setting is judged by text that has gone;
- anchors (plain decoding, the launch setting, and the deepest chain when the launch setting
  is a tree) are run for a few steps at each bucket before anything is predicted there;
  a setting measured at a bucket is then judged by its own step time and, until
  ``trust_requests`` request-steps of tokens are behind it, a blend with the acceptance
  model's token count; an unmeasured one by the cost model alone; and the stalest measured
  one is re-measured every ``refresh_every`` steps, its time window starting again, for up
  to ``explore_steps`` steps while it looks faster (a probe: not a switch, never held), so
  a setting timed in a slow stretch of the machine (its speed swings ~2x) is not buried;
- a challenger replaces the current setting only when predicted ``margin`` faster (the
  launch setting: ``launch_margin``), and not within ``hold_steps`` of the last switch at
  the same bucket (hysteresis: no flapping on noise; a new batch size is judged at once:
  holding batch 1's setting for 16 steps after 7 more requests arrived cost the demo pair
  ~20% of each 8-client burst; and a setting chosen on the model's word alone may be left
  once measured ``explore_steps`` times); speculation must also be predicted
  ``plain_margin`` per batch doubling faster than plain decoding to be chosen at all;
- candidates are only settings whose KV lookahead was reserved at launch, and when forwards
  are captured or compiled per shape, only the captured shape (or plain decoding).

Plain decoding is judged as it runs once the draft lets its requests go: plain steps that
fed the draft nothing are timed apart (``UNFOLLOWED``), and where they have not been timed
at a bucket, new requests there go unfollowed once to time them (``worth_following``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from tpserve.spec.cost_model import CostModel, fit_line, mean
from tpserve.spec.verify import Accepted


class Setting(NamedTuple):
    """A tuple, not a dataclass: settings key every table here, and a frozen dataclass
    rebuilds a tuple to hash itself on each lookup (~40% of the chooser's time per step)."""

    steps: int  # draft depth; 0 = plain decoding
    topk: int
    tokens: int  # verified nodes, root included

    @property
    def off(self) -> bool:
        return self.steps == 0

    @property
    def label(self) -> str:
        if self.off:
            return "off" if self.topk else "off-unfollowed"
        return f"{self.steps}/{self.topk}/{self.tokens}"


OFF = Setting(0, 1, 1)
# Plain steps that fed the draft nothing (no request followed): what plain decoding costs
# once the draft lets go. Measured, never chosen: choosing OFF where following does not pay
# is what leads to such steps (``worth_following``).
UNFOLLOWED = Setting(0, 0, 1)


@dataclass(frozen=True)
class AdaptiveConfig:
    margin: float = 0.05  # a challenger must be predicted this much faster
    plain_margin: float = 0.075  # speculation over plain decoding: this per batch doubling
    launch_margin: float = 0.15  # and this much faster than the launch setting
    hold_steps: int = 16  # steps between two switches made on predictions
    decide_every: int = 4  # steps between two judgements of a settled setting
    explore_steps: int = 3  # steps each anchor runs at a bucket before predictions there
    refresh_every: int = 256  # steps at a bucket between one-step re-measurements of anchors
    single_probe_steps: int = 2  # timed steps a batch-1 probe runs however it looks (_probing)
    refollow_every: int = 4096  # steps after which new requests are followed to re-measure
    refollow_single: int = 256  # the same at batch 1 (``refollow_wait``)
    refollow_doublings: int = 3  # that wait doubles per re-measurement plain still won, up to 8x
    refresh_within: float = 0.25  # settings this close to the best are re-measured sooner
    backoff_after: int = 8  # steps a setting is timed at a bucket before its waits there grow
    quiet_steps: int = 16  # most steps between two checks for a due re-measurement
    alpha: float = 0.2  # weight of a new measurement in the moving averages (times)
    tokens_alpha: float = 0.02  # the same for tokens per step, which swing far more
    fit_alpha: float = 0.005  # weight of a tree step in its line through the chain's tokens
    trust_requests: float = 256.0  # request-steps after which measured tok/s alone counts
    accept_decay: float = 0.99  # per verified tree: acceptance follows the current traffic
    skip_below: float = 0.6  # spec anchors left unexplored where one measured under this x plain
    # Most that following may slow a plain step: beyond it speculation wins however cheap
    # unfollowed plain decoding is, so it need not be measured (demo pair: 15-35%).
    follow_cost: float = 0.35


@dataclass
class Ema:
    value: float = 0.0
    count: int = 0

    def add(self, x: float, alpha: float) -> None:
        """A running mean for the first 1/alpha values, then a moving average."""
        self.count += 1
        weight = max(alpha, 1.0 / self.count)
        self.value = (1 - weight) * self.value + weight * x


@dataclass
class LineFit:
    """Least-squares line y = a + b x over (x, y) pairs, a running mean of the moments for
    the first 1/alpha pairs and a moving one after (like ``Ema``)."""

    count: int = 0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0

    def add(self, x: float, y: float, alpha: float) -> None:
        self.count += 1
        w = max(alpha, 1.0 / self.count)
        self.x += w * (x - self.x)
        self.y += w * (y - self.y)
        self.xx += w * (x * x - self.xx)
        self.xy += w * (x * y - self.xy)

    def at(self, x: float) -> float:
        var = self.xx - self.x ** 2
        slope = (self.xy - self.x * self.y) / var if var > 1e-6 else 1.0
        return self.y + slope * (x - self.x)


@dataclass
class Costs:
    """One setting's measurements at one batch bucket (milliseconds per step)."""

    step_ms: Ema = field(default_factory=Ema)
    forward_ms: Ema = field(default_factory=Ema)  # target decode or verify forward
    draft_ms: Ema = field(default_factory=Ema)
    tokens: Ema = field(default_factory=Ema)  # appended per step
    requests: Ema = field(default_factory=Ema)  # batch size per step (a bucket spans several)
    # Step time averaged over the same steps as tokens and requests: a rate must
    # divide averages of one window. step_ms (faster, for the cost model) against the slow
    # token average overrated whatever ran while a bucket's batch shrank (the tail of a burst
    # of 8: steps got cheaper at once, tokens a step only slowly): 4/1/5 "measured" 2215
    # tok/s at 8 clients where plain decoding made ~1200, and ran 100 steps there.
    window_ms: Ema = field(default_factory=Ema)
    last_step: int = 0
    # A re-measurement restarts the window at this setting's next step here, not when it is
    # chosen: the chosen step may not run it (requests the draft does not follow decode
    # plainly), and an emptied window read as a rate of 0 requests over ~0 ms: the demo
    # pair's chooser showed 4/1/5 at 3e9 tok/s at batch 1 after 8-client bursts.
    restart: bool = False
    # Chosen here at some point (not just explored or probed): new requests are followed to
    # re-measure such a setting once it fell far below the best (``_due``).
    led: bool = False
    # Re-measurements in a row that found this setting far below the best here: each
    # doubles the wait before the next one, from ``refresh_every`` up to ``refollow_every``.
    backoff: int = 0

    def restart_window(self) -> None:
        if self.restart:
            self.window_ms, self.requests = Ema(), Ema()
            self.restart = False

    @property
    def window_steps(self) -> int:
        """Steps timed since the window last (re)started."""
        return 0 if self.restart else self.window_ms.count

    @property
    def tok_s(self) -> float:
        """What this setting's own steps delivered (a ratio of means: a mean of per-step
        ratios would favour lucky fast steps)."""
        return 1e3 * self.tokens.value / max(self.window_ms.value, 1e-6)

    @property
    def request_tok_s(self) -> float:
        """Requests served per second: plain decoding's tok/s."""
        return 1e3 * self.requests.value / max(self.window_ms.value, 1e-6)


@dataclass
class Acceptance:
    """Per depth d: decayed counts of trees that reached d accepted drafts (and so tried
    draft d + 1) and of those that accepted it. Counting only trees that could reach a depth
    keeps a shallow setting, run for a while, from dragging the deep rates to zero."""

    tries: list[float] = field(default_factory=list)
    hits: list[float] = field(default_factory=list)

    def add(self, drafts: list[int], depth: int, decay: float) -> None:
        """``drafts``: per request, the drafts accepted out of ``depth``."""
        grow = max(0, depth - len(self.tries))
        self.tries += [0.0] * grow
        self.hits += [0.0] * grow
        for got in drafts:
            for d in range(min(depth, got + 1)):
                self.tries[d] = self.tries[d] * decay + 1
                self.hits[d] = self.hits[d] * decay + (1.0 if got > d else 0.0)

    @property
    def trees(self) -> float:
        return self.tries[0] if self.tries else 0.0

    def conditional(self) -> tuple[float, ...]:
        """P(accept draft d + 1 | accepted d), up to the deepest depth ever tried."""
        out = []
        for tried, hit in zip(self.tries, self.hits, strict=True):
            if tried <= 0:
                break
            out.append(hit / tried)
        return tuple(out)


def bucket_of(batch: int) -> int:
    return 1 << max(0, batch - 1).bit_length()


def candidates(launch: Setting, lookahead: int, shapes_fixed: bool) -> list[Setting]:
    """Plain decoding, the launch setting, and every chain up to its depth that fits."""
    if shapes_fixed:
        return [OFF, launch]
    chains = [Setting(d, 1, d + 1) for d in range(1, launch.steps + 1) if d + 1 <= lookahead]
    return sorted({OFF, launch, *chains})


class AdaptiveChooser:
    def __init__(self, launch: Setting, allowed: list[Setting],
                 cfg: AdaptiveConfig | None = None) -> None:
        self.cfg = cfg or AdaptiveConfig()
        self.launch, self.allowed = launch, allowed
        self.chains = [s for s in allowed if s.topk == 1 and not s.off]
        deepest = Setting(launch.steps, 1, launch.steps + 1)
        self.anchors = [OFF, launch] + ([deepest] if deepest in allowed and deepest != launch
                                        else [])
        self.reset()

    def reset(self) -> None:
        """Forget every measurement (the start-up warm-up is not traffic: its first steps of
        each setting pay one-time costs, and at the demo pair's batch 1 they had measured the
        launch tree at 10.7 ms a step against 6.5 ms once warm, burying it)."""
        self.costs: dict[int, dict[Setting, Costs]] = {}
        # Acceptance per (bucket, topk): the requests in flight at one concurrency are not
        # those at another, and how well a draft does depends a lot on the text.
        self.accept: dict[tuple[int, int], Acceptance] = {}
        # Tokens per request each speculative setting appends on the text in flight, per
        # bucket, moved by every speculative step whichever setting runs (see
        # ``observe_accepts``); and per (bucket, tree, chain) the tree's tokens per request
        # as a line through the chain's read off its first branch, over the tree's steps.
        self.per_request: dict[tuple[int, Setting], Ema] = {}
        self.paired: dict[tuple[int, Setting, Setting], LineFit] = {}
        self.current = self.launch
        self.steps = 0
        self.last_switch = 0
        self.switch_bucket: int | None = None  # the bucket the last switch was made at
        self.forced = False  # the current OFF was forced (step_aside), not chosen
        # While a setting is re-measured (``_explore``), the one in force before: the
        # re-measurement is not a switch and is never held.
        self.probe_from: Setting | None = None
        self.decided_at: tuple[int, Setting] | None = None  # bucket and setting last judged
        self._follow: dict[int, tuple[int, bool]] = {}  # per bucket: step, worth_following
        # Per bucket: the step before which no re-measurement is due (``_explore``).
        self._quiet: dict[int, int] = {}
        # Per bucket: the step any speculative setting last ran there, and how many times in
        # a row new requests were followed to re-measure speculation there after which plain
        # decoding still led (see ``_refollow_due``).
        self._spec_last: dict[int, int] = {}
        self._refollows: dict[int, int] = {}
        self.decided_step = 0
        self.trial = False  # the current setting was unmeasured at this bucket when chosen
        self.switches = 0
        # Predictions per bucket, dropped whenever that bucket gets a measurement: a step
        # asks for every candidate's several times over (the choice, whether to follow new
        # requests), ~100 us of fitting a step at 8 clients where a plain step is ~3.7 ms.
        self._predictions: dict[int, dict[Setting, float | None]] = {}
        self._models: dict[int, dict[int, CostModel | None]] = {}
        self.last_bucket = 1

    # ---- measurements ----

    def observe(self, setting: Setting, batch: int, step_ms: float, forward_ms: float,
                draft_ms: float, tokens: int, fed: bool = True, switched: bool = False
                ) -> None:
        """One decode step that ran ``setting`` over ``batch`` requests; a plain one that
        ``fed`` the draft nothing counts as ``UNFOLLOWED``; one that ``switched`` from
        another setting is not timed."""
        if switched:
            # The first step after a switch pays for it: the drafting rank grew its tree
            # ahead for the old setting (or none, coming from plain decoding) and grows it
            # again in the step; leaving speculation, rank 0 waits for that rank's run-ahead.
            # Timed, it was a one-step probe's whole window: on the demo pair at batch 1 the
            # launch tree, probed from 3/1/4, timed 4.7 ms against ~3.0 in its own steady
            # steps, and 3/1/4 ran the next ~1000 steps (an in-engine tie that time).
            return
        bucket = bucket_of(batch)
        if setting.off and not fed:
            setting = UNFOLLOWED
            # Only plain decoding's figures move: the speculative predictions (and the cost
            # models behind them) read the fed plain steps, never these. Refitting them all
            # after each such step cost a server at 8 clients ~27 us a step on rank 0.
            known = self._predictions.get(bucket, {})
            known.pop(OFF, None)
            known.pop(UNFOLLOWED, None)
        else:
            self._forget_predictions(bucket)
        row = self.costs.setdefault(bucket, {})
        cost = row.get(setting)
        if cost is None:  # not setdefault: a Costs built per step was ~4 us of it
            cost = row[setting] = Costs()
        cost.restart_window()
        alpha = self.cfg.alpha
        cost.step_ms.add(step_ms, alpha)
        cost.forward_ms.add(forward_ms, alpha)
        cost.draft_ms.add(draft_ms, alpha)
        cost.tokens.add(float(tokens), self.cfg.tokens_alpha)
        if not setting.off:
            self._per_request(bucket, setting).add(tokens / max(batch, 1),
                                                   self.cfg.tokens_alpha)
        cost.requests.add(float(batch), self.cfg.tokens_alpha)
        cost.window_ms.add(step_ms, self.cfg.tokens_alpha)
        cost.last_step = self.steps
        if not setting.off:
            last = self._spec_last.get(bucket)
            if last is not None and self.steps - last > self.refollow_wait(bucket):
                self._refollows[bucket] = self._refollows.get(bucket, 0) + 1
            self._spec_last[bucket] = self.steps

    def observe_accepts(self, setting: Setting, accepted: list[Accepted]) -> None:
        """The accepted paths of one speculative step (its batch is ``len(accepted)``).

        A tree's paths also say what each chain would have accepted on the same text (its
        first branch is the chain's drafts): chains are judged on the text in flight while
        the tree runs. Judged only by what they got when they last ran, the demo pair's
        chooser left the tree whenever the text turned hard (the tree's rate fell, the
        chain's stayed at its easy-text value) and then sat on the chain through the hard
        text, where the tree's second branch pays: 5-8% below the tree pinned (batch 1)."""
        bucket = bucket_of(len(accepted))
        self._forget_predictions(bucket)
        decay = self.cfg.accept_decay
        drafts = [len(a.nodes) - 1 for a in accepted]
        self.accept.setdefault((bucket, setting.topk), Acceptance()).add(
            drafts, setting.steps, decay)
        got = 1 + sum(drafts) / len(drafts)  # tokens per request
        branches = drafts if setting.topk == 1 else [
            a.first_branch for a in accepted if a.first_branch is not None]
        if len(branches) < len(accepted):
            return
        if setting.topk > 1:
            self.accept.setdefault((bucket, 1), Acceptance()).add(branches, setting.steps,
                                                                  decay)
        for chain in self.chains:  # a shallower chain's drafts are a prefix of the branch
            if chain.steps > setting.steps or chain == setting:
                continue
            chain_got = 1 + sum(min(b, chain.steps) for b in branches) / len(branches)
            self._per_request(bucket, chain).add(chain_got, self.cfg.tokens_alpha)
            if setting.topk > 1:
                self.paired.setdefault((bucket, setting, chain), LineFit()).add(
                    chain_got, got, self.cfg.fit_alpha)
        if setting.topk == 1:
            self._follow_trees(bucket, setting, got)

    def _follow_trees(self, bucket: int, chain: Setting, got: float) -> None:
        """While ``chain`` runs, each tree measured here follows the text through it: its
        tokens per request read off the line fitted over its own steps (tree's against the
        chain's on its first branch; on hard text the tree's second branch adds more, so a
        line, not a ratio). Every setting's figure then moves on the same steps: an
        estimate left at the text it last ran on is what misled."""
        for (b, tree, paired_chain), fit in self.paired.items():
            if b == bucket and paired_chain == chain:
                self._per_request(bucket, tree).add(fit.at(got), self.cfg.tokens_alpha)

    def _per_request(self, bucket: int, setting: Setting) -> Ema:
        return self.per_request.setdefault((bucket, setting), Ema())

    # ---- prediction ----

    def _forget_predictions(self, bucket: int) -> None:
        self._predictions.pop(bucket, None)
        self._models.pop(bucket, None)

    def model(self, bucket: int, topk: int) -> CostModel | None:
        """The cost model at ``bucket`` for settings of branching ``topk``; None until plain
        decoding and one setting of that branching were measured there."""
        known = self._models.setdefault(bucket, {})
        if topk not in known:
            known[topk] = self._model(bucket, topk)
        return known[topk]

    def _model(self, bucket: int, topk: int) -> CostModel | None:
        table = self.costs.get(bucket, {})
        plain = table.get(OFF)
        spec = {s: c for s, c in table.items() if not s.off and s.topk == topk}
        acc = self.accept.get((bucket, topk))
        if plain is None or not spec or acc is None or not acc.trees:
            return None
        points = [(1.0, plain.forward_ms.value)] + [(float(s.tokens), c.forward_ms.value)
                                                    for s, c in table.items() if not s.off]
        slope, intercept = fit_line(points)
        return CostModel(
            draft_ms_per_depth=mean([c.draft_ms.value / s.steps for s, c in spec.items()]),
            verify_intercept_ms=intercept, verify_ms_per_node=slope,
            overhead_ms=plain.step_ms.value - plain.forward_ms.value,
            spec_overhead_ms=mean([c.step_ms.value - c.draft_ms.value - c.forward_ms.value
                                    for c in spec.values()]),
            conditional_rates=acc.conditional())

    def predict(self, bucket: int, setting: Setting) -> float | None:
        """Predicted tok/s of ``setting`` at ``bucket`` (None: not enough measurements)."""
        known = self._predictions.setdefault(bucket, {})
        if setting not in known:
            known[setting] = self._predict(bucket, setting)
        return known[setting]

    def _predict(self, bucket: int, setting: Setting) -> float | None:
        # Each setting is judged at the batch sizes it was measured at (a bucket spans
        # several; judging all at the bucket's top would favour whichever ran on fewer).
        cost = self.costs.get(bucket, {}).get(setting)
        if setting.off:
            # Chosen, plain decoding lets the draft go where following does not pay, so
            # it is judged as it runs unfollowed once that was measured here; never below
            # the fed steps, which cost more (a figure under theirs was timed in a slow
            # stretch: demo pair, 8 clients, 1190 tok/s unfollowed against 1880 fed, and
            # speculation ran there at ~0.8x of a plain server).
            free = self._unfollowed(bucket) if setting == OFF else None
            rates = [c.request_tok_s for c in (cost, free) if c is not None]
            return max(rates) if rates else None
        model = self.model(bucket, setting.topk)
        if model is None:
            return None
        if cost is not None:  # measured here: its own step time, acceptance blended
            rate = cost.request_tok_s
            modeled = rate * model.accept_length(setting.steps)
            # Trusted after enough request-steps of the text in flight, whichever ran them.
            tokens = self._per_request(bucket, setting)
            trust = min(1.0, tokens.count * cost.requests.value / self.cfg.trust_requests)
            return trust * rate * tokens.value + (1 - trust) * modeled
        seen = self.costs[bucket][OFF].requests.value  # model() needs plain measured here
        return model.tok_s(setting.steps, setting.tokens, round(seen) or 1)

    # ---- the choice ----

    def choose(self, batch: int) -> Setting:
        """The setting for the next decode step over ``batch`` requests."""
        self.steps += 1
        bucket = self.last_bucket = bucket_of(batch)
        pick = self._explore(bucket)
        if pick is None:
            pick = self._exploit(bucket)
            chosen = None if pick.off else self.costs.get(bucket, {}).get(pick)
            if chosen is not None and self.probe_from is None:
                chosen.led = True
                self._refollows.pop(bucket, None)  # speculation leads here again
        self.current = pick
        return pick

    def worth_following(self, batch: int) -> bool:
        """Whether the draft should follow a request admitted into a batch of ``batch``: yes
        unless plain decoding is measured clearly faster at that bucket and speculation was
        measured there recently enough (``_refollow_due``). A request not followed never
        speculates, but costs nothing (a followed one pays for its auxiliary states and
        deferred draft rows until it is let go: 15-35% of a plain step)."""
        bucket = bucket_of(batch)
        known = self._follow.get(bucket)
        if known is not None and self.steps - known[0] < self.cfg.decide_every:
            return known[1]  # asked every plain step; predicting every setting is ~70 us
        follow = self._worth_following(bucket)
        self._follow[bucket] = (self.steps, follow)
        return follow

    def _unfollowed(self, bucket: int) -> Costs | None:
        """Unfollowed plain decoding at ``bucket``, once measured there."""
        free = self.costs.get(bucket, {}).get(UNFOLLOWED)
        return free if free is not None and free.step_ms.count >= self.cfg.explore_steps \
            else None

    def _worth_following(self, bucket: int) -> bool:
        table = self.costs.get(bucket, {})
        off = table.get(OFF)
        spec = [p for s in self.allowed if not s.off
                and (p := self.predict(bucket, s)) is not None]
        if off is None or not spec:
            return True
        # Re-measuring speculation here needs followed requests, and following every new one
        # for it as soon as a refresh was due (every refresh_every steps) kept requests of
        # the demo pair's 8-client bursts fed: plain steps of 5.55 ms against ~4.85 on a
        # server without a draft. Requests admitted while a burst ramps up are followed for
        # their first MAX_DEFERRED tokens anyway.
        if self._refollow_due(bucket) or any(
                self._due(bucket, s, c) for s, c in table.items() if not s.off):
            return True
        # Against plain decoding as it runs unfollowed, and by the margin speculation needs
        # to be chosen: following where it was 10% short of that (an old slack) fed every
        # request of the demo pair's 8-client bursts (4/1/5 at 0.98x of plain there)
        # through steps the chooser kept plain, ~1 ms each.
        margin = 1 + self.plain_margin(bucket)
        free = self._unfollowed(bucket)
        plain = self.predict(bucket, OFF)  # unfollowed where measured, never under ``off``
        if free is not None and plain is not None \
                and self.steps - free.last_step <= self.cfg.refollow_every:
            return max(spec) >= plain * margin
        # Not known here: where speculation could lose to it, new requests go unfollowed
        # once to measure it (a probe: they decode plainly). The fed plain steps (``off``)
        # are no guide, since the drafting rank's share of the feeding does not show in rank
        # 0's phases: demo pair at 8 clients, TP = 2, 5.0 ms a fed plain step against ~4.1
        # unfollowed, and 3/1/4 (1850 tok/s, over 1.2x the fed 1370) ran there at 0.67-0.79x
        # of a server without a draft.
        return max(spec) >= off.request_tok_s * (1 + self.cfg.follow_cost) * margin

    def step_aside(self, batch: int) -> Setting:
        """The next step must decode plainly (the draft does not follow every request). Not
        a choice: the next one is free of the hold."""
        self.steps += 1
        self.last_bucket = bucket_of(batch)
        self.current, self.forced, self.probe_from = OFF, True, None
        return OFF

    def _explore(self, bucket: int) -> Setting | None:
        """An anchor that still needs (re-)measuring at this bucket, else None. Once plain
        decoding and one speculative anchor are measured, the other speculative anchors are
        skipped where that one delivered under ``skip_below`` of plain's tok/s: each of their
        steps costs several plain ones (demo pair, 8 clients: 33-43 ms against 5 ms), and a
        short burst of load pays the whole exploration."""
        if self.probe_from is None and self.steps < self._quiet.get(bucket, 0):
            return None  # set below, only once every anchor was measured here
        # Unfollowed plain steps are measured only as they come (see ``worth_following``).
        table = {s: c for s, c in self.costs.get(bucket, {}).items() if s != UNFOLLOWED}
        measured = {a: c for a, c in table.items() if c.step_ms.count >= self.cfg.explore_steps}
        plain = measured.get(OFF)
        spec = [c.tok_s for a, c in measured.items() if not a.off]
        hopeless = plain is not None and bool(spec) and (
            max(spec) < self.cfg.skip_below * plain.tok_s)
        need = [a for a in self.anchors if a not in measured and not (hopeless and not a.off)]
        if need:
            return self.current if self.current in need else need[0]
        # Every setting measured here is re-measured now and then, anchors included, and its
        # time window starts again from that step: one step added to a 50-step average
        # moved it by 2%, so a setting timed in a slow stretch of the machine stayed buried
        # (the demo pair's tree at 7.4 ms a step against its usual 5.4, 374 tok/s to a
        # chain's 608, for good). Its tokens per request need no restart: every
        # speculative step moves them (see ``observe_accepts``).
        if self.probe_from is not None:
            return None
        stale = min(table, key=lambda s: table[s].last_step)
        if self.steps - table[stale].last_step <= self.cfg.refresh_every:
            return None
        best = self._best(bucket)
        waits = {s: self._refresh_interval(bucket, s, best) for s in table}
        due = [s for s in table if self.steps - table[s].last_step > waits[s]]
        if not due:
            # Nothing is due until the soonest wait runs out (or ``quiet_steps``: the waits
            # move with the predictions).
            soonest = min(table[s].last_step + waits[s] for s in table) + 1
            self._quiet[bucket] = min(soonest, self.steps + self.cfg.quiet_steps)
            return None
        stale = min(due, key=lambda s: table[s].last_step)
        table[stale].restart = True
        table[stale].backoff += 1  # undone when it is judged near the best again
        if stale != self.current:
            self.probe_from = self.current
        else:
            # Already running: its next step is the re-measurement. Fed plain decoding stays
            # due while a steady load goes unfollowed (its steps time as UNFOLLOWED), and
            # working this out again every step was ~20 of the chooser's ~35 us a plain
            # step at 8 clients (demo pair's settings, 2-vCPU Zen 3).
            self._quiet[bucket] = self.steps + self.cfg.quiet_steps
        return stale

    def _refresh_interval(self, bucket: int, setting: Setting, best: float | None) -> int:
        """Steps between re-measurements of ``setting``: ``refresh_every`` while it is
        predicted within ``refresh_within`` of the ``best`` prediction here; else
        ``refresh_every`` too the first time, then twice as long after each re-measurement
        that found it far below, up to ``refollow_every``.

        A speculative step at 8 clients costs 3-4 plain ones and hands its requests
        different token counts, so the burst's last ones finish alone; re-measuring 4/2/8
        there (0.66x of plain) every 256 steps cost the demo pair ~8 extra small-batch steps
        a burst, hence the growing wait. But not ``refollow_every`` from the start: the demo
        pair's launch tree, timed at 6.6 ms a step in its first steps (~2.8 once warm), sat
        behind 4/1/5 for 569 steps at batch 1; and a tree timed in a slow stretch (a
        profiler attached to the drafting rank: 27 ms a step, 0.42x of plain) stayed buried,
        its requests unfollowed, while it ran at 1.4x of plain before and after.

        Plain decoding is always due at ``refresh_every``: it is the figure every
        speculative setting must beat, and one plain step is cheap; timed in a slow stretch,
        it stayed at 225 tok/s (true: 400) for 1200 steps of hard text in the fake-machine
        test, while a chain ran at 375."""
        if setting.off:
            return self.cfg.refresh_every
        cost = self.costs[bucket][setting]
        if not self._far(bucket, setting, best):
            cost.backoff = 0
            return self.cfg.refresh_every
        return self._backed_off(cost, self.cfg.refollow_every)

    def _backed_off(self, cost: Costs, longest: int) -> int:
        """``refresh_every`` doubled per re-measurement in a row that found the setting far
        below the best (``Costs.backoff``), up to ``longest`` steps; ``refresh_every`` while
        it has been timed for fewer than ``backoff_after`` steps at the bucket. A few steps
        are no grounds for a long wait: on the demo pair (batch 1 mixed with 8-client
        bursts) 4/1/5 was timed over 4 steps in all, at 2.6 ms a step (1.66 in its steady
        runs), its wait doubled five times, and 2/1/3 ran for 4096 steps: batch 1 at
        1.36-1.39x of plain, 1.59-1.70x on a twin server in the same run."""
        if cost.step_ms.count < self.cfg.backoff_after:
            return self.cfg.refresh_every
        return min(longest, self.cfg.refresh_every << min(cost.backoff, 16))

    def _far(self, bucket: int, setting: Setting, best: float | None) -> bool:
        """Whether ``setting`` is predicted more than ``refresh_within`` below ``best``."""
        mine = self.predict(bucket, setting)
        return mine is not None and best is not None and (
            mine < best * (1 - self.cfg.refresh_within))

    def refollow_wait(self, bucket: int) -> int:
        """Steps without speculation at ``bucket`` before new requests there are followed
        again to re-measure it (``_refollow_due``, doubling per re-measurement plain won).

        Long where a batch is many requests: following them feeds the whole batch (see
        ``_refollow_due``). At batch 1 it is one request's few probe steps, and a long wait
        is a trap: a fresh demo pair timed its tree at 2.75 ms a step over its first 12
        requests (~1.5 ms warm) against plain at 0.9, let new requests go unfollowed, and
        served the next 12 at 0.91x of a plain server, plain decoding for 1952 steps with
        2100 more to wait."""
        return self.cfg.refollow_single if bucket == 1 else self.cfg.refollow_every

    def _refollow_due(self, bucket: int) -> bool:
        """Whether speculation at ``bucket`` has gone unmeasured long enough that new requests
        are followed to re-measure it: ``refollow_wait`` steps after any speculative setting
        last ran there, twice that after each such re-measurement plain decoding still led
        (up to ``refollow_doublings`` times).

        One wait for the bucket, not one per setting: each measured setting's own clock had
        new requests followed again soon after the last re-measurement, and on the demo pair
        under a steady 8-client load fed plain steps (2.8 ms against 1.4 unfollowed) were
        ~7% of all steps. Any speculative step moves every setting's acceptance, and the
        followed requests let ``_explore`` re-time the rest."""
        last = self._spec_last.get(bucket)
        if last is None:
            return False
        doublings = min(self._refollows.get(bucket, 0), self.cfg.refollow_doublings)
        return self.steps - last > self.refollow_wait(bucket) << doublings

    def _due(self, bucket: int, setting: Setting, cost: Costs) -> bool:
        """Whether speculative ``setting`` needs new requests followed at ``bucket`` to be
        re-measured before ``_refollow_due``: where it once led and fell far below, as soon
        as its backed-off re-measurement is due (``_backed_off``). Not
        when a setting near the best is due (every ``refresh_every`` steps): following new
        requests of the demo pair's 8-client bursts for that, where 4/1/5 is predicted ~8%
        over plain but short of the 20% it needs, fed a whole burst each time (0.89x of a
        plain server in a 10-round run, 0.92-0.95x without).

        The wait counts from the last speculative step at the bucket (whichever setting ran)
        and keeps doubling past ``refollow_every`` up to the bucket's longest wait: a setting
        chosen once in a fresh server's first steps (plain decoding timed slow while it
        warmed up) otherwise had new requests followed every 4096 steps of a steady 8-client
        load for good, each setting on its own clock (the fake machine: 4-7% of all steps
        fed, ~1% speculative at a batch where speculation loses)."""
        waited = self.steps - self._spec_last.get(bucket, cost.last_step)
        if not cost.led or waited <= self.cfg.refresh_every:
            return False
        if not self._far(bucket, setting, self._best(bucket)):
            return False
        return waited > self._backed_off(cost, self.refollow_wait(bucket)
                                         << self.cfg.refollow_doublings)

    def _best(self, bucket: int) -> float | None:
        """The best prediction among the settings measured at ``bucket``."""
        return max((p for s in self.costs.get(bucket, {})
                    if s != UNFOLLOWED and (p := self.predict(bucket, s)) is not None),
                   default=None)

    def _exploit(self, bucket: int) -> Setting:
        settled = (not self.forced and not self.trial and self.probe_from is None
                   and self.decided_at == (bucket, self.current))
        if settled and self.steps - self.decided_step < self.cfg.decide_every:
            # Predicting every setting costs ~70 us of Python a step (a 4/2/8 step is ~5 ms
            # at batch 1); settings do not change faster than every few steps anyway.
            return self.current
        self.decided_at, self.decided_step = (bucket, self.current), self.steps
        preds = {s: p for s in self.allowed if (p := self.predict(bucket, s)) is not None}
        if not preds:
            return self.current
        if OFF in preds:
            preds[OFF] *= 1 + self.plain_margin(bucket)
        if self.launch in preds:
            # Among speculative settings the launch one (chosen by measurement, or by the
            # user) is left only for a clear gain: settings measured in different moments of
            # a machine whose speed swings ~2x differ by more than 5% on noise alone, and on
            # the demo pair each such switch at batch 1 lost to the launch tree pinned.
            preds[self.launch] *= 1 + self.cfg.launch_margin
        table = self.costs.get(bucket, {})
        if self.probe_from is not None:
            if self._probing(bucket, table, preds):
                return self.current
            self.current, self.probe_from = self.probe_from, None
        best = max(preds, key=lambda s: preds[s])
        now = preds.get(self.current)
        forced, self.forced = self.forced, False
        tried = self.trial and self.current in table and (
            table[self.current].step_ms.count >= self.cfg.explore_steps)
        free = (forced or tried or self.switch_bucket not in (None, bucket)
                or self.steps - self.last_switch >= self.cfg.hold_steps)
        if best == self.current or (now is not None and not free):
            return self.current
        if now is not None and preds[best] <= now * (1 + self.cfg.margin):
            return self.current
        self.last_switch, self.switch_bucket = self.steps, bucket
        # A switch to a setting only the model knows here is a trial: once measured for
        # explore_steps it may be left at once (a 33-step request cannot afford a 16-step
        # hold on a chain that measured slower than predicted).
        self.trial = best not in table
        self.switches += 1
        return best

    def plain_margin(self, bucket: int) -> float:
        """How much faster than plain decoding speculation must be predicted at ``bucket``.

        It has to earn its place: it costs memory, draft work and a batch's mixing of prompt
        chunks, so near a tie plain decoding wins; and more so the larger the batch, because
        speculating requests advance at their own acceptance (2.4 to 4.9 tokens a step on
        the demo prompts) and the slowest one sets when a burst ends: at 8 clients the demo
        pair ran 4/1/5 at 0.92x of plain's rate per step and finished the burst's last
        request at ~0.65x, then ran the stragglers at small batches. Hence
        ``plain_margin`` x (1 + log2 B): at 5% a doubling (20% at batch 8) the chooser still
        ran 4/1/5 there whenever a stretch of easy text timed it 1.2x of plain a step, and a
        speculative server delivered 0.86-1.01x of a plain one at 8 clients (mean 0.94, 5
        runs; Xeon, TP = 2 shm); at 7.5% (30%), 0.95-0.98x (mean 0.97) in the same
        alternation, batch 1 alike (1.61-1.77x against 1.64-1.73x)."""
        return self.cfg.plain_margin * bucket.bit_length()

    def _probing(self, bucket: int, table: dict[Setting, Costs],
                 preds: dict[Setting, float]) -> bool:
        """Whether the setting being re-measured runs another step: while it has fewer than
        ``explore_steps`` steps timed since the re-measurement began and is predicted
        ``margin`` faster than the setting in force (one step timed on a machine this noisy
        is no grounds to switch), and in any case until ``probe_steps`` are timed (then one
        that looks slower is left at once; the switch step is not timed, ``observe``)."""
        probed, home = self.current, self.probe_from
        timed = table[probed].window_steps if probed in table else 0
        if timed >= self.cfg.explore_steps or probed not in preds or home not in preds:
            return False
        return (timed < self.probe_steps(bucket)
                or preds[probed] > preds[home] * (1 + self.cfg.margin))

    def probe_steps(self, bucket: int) -> int:
        """Timed steps a re-measurement at ``bucket`` runs whatever they say (``_probing``).

        One, except at batch 1: ``single_probe_steps`` (two). There a probe costs a request
        a step or two, and one step timed on this VM (steps swing 10-20%) decided whether
        speculation came back. Left after that step, a re-follow (``_refollow_due``) found
        plain decoding ahead again and doubled its wait: on the fake machine of
        ``test_batch_one_recovers_from_speculation_timed_in_a_slow_start``, over 20 seeds,
        one never speculated again and one did in only 59% of steps 1000 to 4000 (80-99% for
        every seed with two steps; all ``explore_steps`` did no better there and cost more
        where probes are frequent)."""
        return max(1, self.cfg.single_probe_steps) if bucket == 1 else 1

    def snapshot(self) -> dict[str, Any]:
        bucket = self.last_bucket
        cur = self.costs.get(bucket, {}).get(self.current)
        # last_step (the chooser step it was last timed at) and backoff (re-measurements in
        # a row that found it far below the best) say when a setting is next re-timed: a
        # live server once sat on 2/1/3 with 4/1/5 timed over only its first 4 steps.
        table = {str(b): {s.label: {"predicted_tok_s": self.predict(b, s),
                                    "measured_tok_s": c.tok_s, "steps": c.step_ms.count,
                                    "step_ms": c.step_ms.value, "last_step": c.last_step,
                                    "backoff": c.backoff}
                          for s, c in sorted(row.items())}
                 for b, row in sorted(self.costs.items())}
        return {"choice": self.current.label, "batch_bucket": bucket,
                "predicted_tok_s": self.predict(bucket, self.current),
                "measured_tok_s": cur.tok_s if cur is not None else None,
                "switches": self.switches, "steps": self.steps,
                "probing_from": None if self.probe_from is None else self.probe_from.label,
                "candidates": [s.label for s in self.allowed], "by_batch": table}
