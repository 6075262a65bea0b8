"""The agent loop: every environment, single- or multi-turn, runs through `run_rollouts`.

Turns reach the backend in one of two ways. Turn-synchronous: each turn makes ONE `backend.generate`
call for all unfinished episodes of the batch, then every environment steps. Streamed (the default where
the backend batches continuously): one `backend.serve` session, each episode's next request fed as soon as
its own environment step is done, while the others decode. The first turn
renders the row's prompt (and tool schemas); later turns render only what the environment added (tool
results, scripted follow-ups) and append its token ids after the sampled tokens, which are kept exactly as
sampled. Images are attributed to the turn that introduced them and decoded once per batch.

Faults are sorted by whose they are: bad data (a row the env cannot start or score, an undecodable prompt
image) raises a GymvError naming the row; an environment call that fails unexpectedly marks only its own
trajectory's `error` (excluded from training, counted); what the model does wrong (malformed tool calls,
wrong answers) is part of the episode: tool-error results, reward 0 with a `failure_reason`.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from gymv.backends.generation.base import GenerationBackend, GenerationRequest, RequestFeed, SamplingParams
from gymv.data.images import ImageError
from gymv.envs.protocol import Environment, ModelTurn, RowError, StepResult
from gymv.envs.rows import agent_name, row_tools, to_chat_tool
from gymv.errors import GymvError
from gymv.rollout.episode import Episode
from gymv.rollout.images import ImageCache
from gymv.rollout.parse import parse_turn
from gymv.rollout.record import to_rollout_record
from gymv.rollout.render import ChatRenderer, assistant_dict, message_dict, tool_message_dict
from gymv.rollout.spans import check_image_spans
from gymv.rollout.tool_formats import get_tool_call_format
from gymv.rollout.types import Trajectory

__all__ = ["build_sft_sample", "run_rollouts", "to_rollout_record"]

_MODEL_ITEM_TYPES = ("message", "function_call", "reasoning")
MAX_ENV_THREADS = 64  # concurrent server calls per batch (environments with concurrent_calls)


BREAKDOWN = ("env_open_s", "render_s", "image_decode_s", "parse_s", "env_step_s", "env_verify_s",
             "backend_encode_s", "backend_prefill_s", "backend_capture_s", "backend_decode_s")
"""Where a rollout's time goes (`stats["breakdown/..."]`): environment calls (open, step, verify), rendering and
tokenizing (image decoding, also counted on its own, included), parsing the model's turns, and the
generation backend's own split of its calls (image encoding, prefill, first-call capture, the decode loop)."""


def _where(source: str | None, task_index: int, sample_index: int | None = None) -> str:
    base = f"{source} line {task_index + 1}" if source else f"row {task_index}"
    return base if sample_index is None else f"{base} sample {sample_index}"


def _agent_name(row: dict, env: Environment) -> str:
    return agent_name(row) or env.agent_name


def _turn_seed(base: int | None, turn: int) -> int | None:
    return None if base is None else (base * 1_000_003 + turn * 7_919) % (2**63 - 1)


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _tools(row: dict, env: Environment) -> list[dict] | None:
    """Tool schemas the model is shown: the row's own (what the data poses), else the environment's."""
    tools = row_tools(row) or env.tools()
    return [to_chat_tool(t) for t in tools if isinstance(t, dict)] or None


class _Resolver:
    def __init__(self, env_for: Callable[[dict], Environment] | Environment, source: str | None):
        self.env_for, self.source = env_for, source

    def __call__(self, row: dict, task_index: int) -> Environment:
        if isinstance(self.env_for, Environment):
            return self.env_for
        env = self.env_for(row)
        if not isinstance(env, Environment):
            raise GymvError("no environment handles this row", where=_where(self.source, task_index),
                            fix="set the row's agent_ref.name to an installed environment's agent (see `gymv env list`)")
        return env


def _check_limits(group_size: int, max_turns: int, max_rollout_tokens: int, max_seq_len: int,
                  max_images: int | None) -> None:
    for name, value, low in (("group_size", group_size, 1), ("max_turns", max_turns, 1),
                             ("max_rollout_tokens", max_rollout_tokens, 1), ("max_seq_len", max_seq_len, 2)):
        if value < low:
            raise GymvError(f"{name} must be at least {low}, got {value}", fix=f"set {name} to {low} or more")
    if max_images is not None and max_images < 0:
        raise GymvError(f"max_images must be >= 0, got {max_images}",
                        fix="set vision.max_images_per_sample to 0 or more")


def _open(ep: Episode) -> None:
    """Start the episode's environment (a server call for remote ones); a failure marks only this episode."""
    try:
        ep.state = ep.env.start(ep.row, where=ep.where)
    except (RowError, ImageError):  # the row's own fault (a prompt image that is no usable image): not the env's
        raise
    except Exception as e:  # an environment that fails to start (server down, plugin bug)
        ep.fail(f"environment start failed: {_describe(e)}")


def _each(fn: Callable, items: list) -> list:
    """fn over items in order; concurrently when every item's environment allows concurrent calls."""
    def env_of(item):
        return (item[0] if isinstance(item, tuple) else item).env

    if len(items) > 1 and all(env_of(i).concurrent_calls for i in items):
        with ThreadPoolExecutor(max_workers=min(MAX_ENV_THREADS, len(items))) as pool:
            return list(pool.map(fn, items))
    return [fn(i) for i in items]


def _start(ep: Episode, renderer: ChatRenderer, cache: ImageCache, adapter, *, max_seq_len: int,
           max_images: int | None) -> None:
    """Render and tokenize the prompt of an opened episode."""
    if ep.error is not None:
        return
    ep.tools = _tools(ep.row, ep.env)
    text, images = renderer.prompt(ep.state.messages, ep.tools)
    decoded = [cache.get(im, where=ep.at(0)) for im in images]
    if max_images is not None and len(decoded) > max_images:
        ep.fail(f"the prompt has {len(decoded)} images, over the limit of {max_images} (vision.max_images_per_sample)")
        return
    ids = adapter.encode_text(text, [p for p, _ in decoded], where=ep.at(0))
    if len(ids) >= max_seq_len:
        ep.fail(f"the prompt has {len(ids)} tokens, leaving no room to generate within max_seq_len {max_seq_len} "
                f"(raise model.max_seq_len above it)")
        return
    ep.append_inserted(ids, decoded, 0)


def _model_item_index(ep: Episode, first: int, n_items: int) -> int | None:
    """Index of the last transcript item the model call produced (where its token record goes)."""
    k = first + n_items - 1
    out = ep.state.output if ep.state is not None else []
    if n_items and k < len(out) and isinstance(out[k], dict) and out[k].get("type") in _MODEL_ITEM_TYPES:
        return k
    return None


def run_rollouts(backend: GenerationBackend, adapter, tokenizer, chat_template: str | None,
                 env_for: Callable[[dict], Environment] | Environment, rows: Sequence[tuple[int, dict]], *,
                 group_size: int, params: SamplingParams, max_turns: int, max_rollout_tokens: int, max_seq_len: int,
                 weights_version: int = 0, max_images: int | None = None, seed: int | None = None,
                 max_image_pixels: int | None = None, source: str | None = None,
                 stats: dict | None = None, chat_template_kwargs: dict | None = None,
                 tool_call_format: str | None = None, streamed: bool | None = None) -> list[Trajectory]:
    """Run `group_size` episodes of each (dataset index, row); trajectories come back grouped, in row order.

    Budgets: each model call generates at most `params.max_new_tokens`; an episode generates at most
    `max_rollout_tokens` in all; its whole sequence never exceeds `max_seq_len`. An episode that would cross
    a budget ends at the last turn boundary with `truncated=True`, finish_reason "length". `seed` (else
    `params.seed`) makes sampling deterministic; each turn draws from its own derived seed. `stats`, when
    given, receives timings and image-dedup counts. `chat_template_kwargs` go into every rendering (pass
    the same to `build_sft_sample` so that SFT and RL see the same tokens); `tool_call_format` names how the
    model writes tool calls (gymv.rollout.tool_formats; None: hermes).

    `streamed` picks how turns reach the backend. Turn-synchronous (False): one `generate` call per turn for
    every unfinished episode, then every environment steps. Streamed (True): one `backend.serve` session;
    each episode's next request joins the running batch as soon as its own step and rendering are done, and
    each request draws from a seed of (seed, episode, turn), so a seeded run does not depend on which episode
    finished first. None: streamed when the backend batches continuously (`serves_continuously`).
    """
    _check_limits(group_size, max_turns, max_rollout_tokens, max_seq_len, max_images)
    t_start = time.perf_counter()
    fmt = get_tool_call_format(tool_call_format)
    renderer = ChatRenderer(tokenizer, chat_template, chat_template_kwargs, tool_call_format=fmt)
    cache = ImageCache(max_pixels=max_image_pixels)
    resolve = _Resolver(env_for, source)
    episodes: list[Episode] = []
    for task_index, row in rows:
        env = resolve(row, task_index)
        for g in range(group_size):
            episodes.append(Episode(task_index, g, row, env, _where(source, task_index, g if group_size > 1 else None),
                                    _agent_name(row, env)))
    parts = dict.fromkeys(BREAKDOWN, 0.0)
    t0 = time.perf_counter()
    _each(_open, episodes)
    t1 = time.perf_counter()
    cache.prefetch(im for ep in episodes if ep.error is None for m in ep.state.messages for im in m.images)
    for ep in episodes:
        _start(ep, renderer, cache, adapter, max_seq_len=max_seq_len, max_images=max_images)
    env_s = time.perf_counter() - t0
    parts["env_open_s"] += t1 - t0
    parts["render_s"] += env_s - (t1 - t0)

    run = _Run(backend, adapter, tokenizer, fmt, renderer, cache, params, seed if seed is not None else params.seed,
               max_turns, max_rollout_tokens, max_seq_len, max_images, parts)
    streams = getattr(backend, "serves_continuously", False) if streamed is None else streamed
    gen_s, calls, turn_env_s = (_turns_streamed if streams else _turns_synchronous)(run, episodes)
    env_s += turn_env_s

    t0 = time.perf_counter()
    trajectories = _each(lambda e: _score(e, weights_version), episodes)
    env_s += time.perf_counter() - t0
    parts["env_verify_s"] += time.perf_counter() - t0
    parts["image_decode_s"] = cache.decode_s
    if stats is not None:
        stats.update({"generation_s": gen_s, "env_s": env_s, "total_s": time.perf_counter() - t_start,
                      "generate_calls": calls, "image_decodes": cache.decodes, "image_decode_hits": cache.hits,
                      **{f"breakdown/{k}": v for k, v in parts.items()}})
    return trajectories


@dataclass
class _Run:
    """What every turn of one `run_rollouts` call needs."""

    backend: GenerationBackend
    adapter: object
    tokenizer: object
    fmt: object
    renderer: ChatRenderer
    cache: ImageCache
    params: SamplingParams
    base_seed: int | None
    max_turns: int
    max_rollout_tokens: int
    max_seq_len: int
    max_images: int | None
    parts: dict

    def cap(self, e: Episode) -> int:
        """The most tokens the episode's next model call may generate (every budget at once)."""
        return min(self.params.max_new_tokens, self.max_seq_len - len(e.ids), self.max_rollout_tokens - e.generated)

    def request(self, e: Episode, turn: int, **kw) -> GenerationRequest:
        ids = e.request_ids()
        check_image_spans(self.adapter, ids, e.images, e.image_turns, e.model_calls, where=e.where)
        return GenerationRequest(ids, list(e.images), where=e.at(turn), **kw)

    def record(self, e: Episode, out, cap: int, turn: int) -> _Turn:
        return _record_turn(e, out, cap, turn, adapter=self.adapter, tokenizer=self.tokenizer, fmt=self.fmt)

    def end(self, e: Episode, t: _Turn, result: StepResult, turn: int) -> None:
        _end_turn(e, t, result, turn, renderer=self.renderer, cache=self.cache, adapter=self.adapter,
                  max_turns=self.max_turns, max_rollout_tokens=self.max_rollout_tokens, max_seq_len=self.max_seq_len,
                  max_images=self.max_images)

    def add_backend_timing(self) -> None:
        for k, v in (getattr(self.backend, "last_timing", None) or {}).items():
            if f"backend_{k}" in self.parts:
                self.parts[f"backend_{k}"] += v


def _turns_synchronous(run: _Run, episodes: list[Episode]) -> tuple[float, int, float]:
    """Turn by turn: one `generate` call for every unfinished episode, then every environment steps.
    (seconds generating, generate calls, seconds parsing, stepping and rendering)."""
    gen_s, env_s, calls, parts = 0.0, 0.0, 0, run.parts
    for turn in range(run.max_turns):
        active = [e for e in episodes if not e.done]
        if not active:
            break
        caps = [run.cap(e) for e in active]
        requests = [run.request(e, turn) for e in active]
        t0 = time.perf_counter()
        outs = run.backend.generate(requests, replace(run.params, max_new_tokens=max(caps),
                                                      seed=_turn_seed(run.base_seed, turn)))
        gen_s += time.perf_counter() - t0
        calls += 1
        run.add_backend_timing()
        if len(outs) != len(requests):
            raise GymvError(f"the generation backend answered {len(outs)} of {len(requests)} requests",
                            fix="a backend must return one output per request, in order")
        t0 = time.perf_counter()
        taken = [run.record(e, out, cap, turn) for e, cap, out in zip(active, caps, outs)]
        t1 = time.perf_counter()
        results = _each(lambda et: _step_env(et[0], et[1], turn), list(zip(active, taken)))
        t2 = time.perf_counter()
        for e, t, result in zip(active, taken, results):
            if result is not None:
                run.end(e, t, result, turn)
        t3 = time.perf_counter()
        env_s += t3 - t0
        parts["parse_s"] += t1 - t0
        parts["env_step_s"] += t2 - t1
        parts["render_s"] += t3 - t2
    return gen_s, calls, env_s


def _request_seed(base: int | None, episode: int, turn: int) -> int | None:
    """A streamed request's own seed: a function of (base seed, episode, turn) alone."""
    return None if base is None else (base * 1_000_003 + episode * 104_729 + turn * 7_919) % (2**63 - 1)


def _turns_streamed(run: _Run, episodes: list[Episode]) -> tuple[float, int, float]:
    """One `backend.serve` session for the whole batch. An output is recorded as soon as the backend hands it
    back; the episode's environment then steps in a worker thread (calls to an environment without
    `concurrent_calls` one at a time) and its next request is fed at once, while other episodes decode.
    Recording and rendering hold one lock (the tokenizer and the image cache are shared); only environment
    calls overlap. A row error raised in a worker cancels the session and is raised here."""
    parts, lock = run.parts, threading.Lock()
    env_locks = {id(e.env): threading.Lock() for e in episodes if not e.env.concurrent_calls}
    feed = RequestFeed()
    turn_of = [0] * len(episodes)
    cap_of = [0] * len(episodes)
    live = [i for i, e in enumerate(episodes) if not e.done]
    remaining = len(live)
    failures: list[BaseException] = []
    timing = {"env_s": 0.0}

    def feed_turn(i: int) -> None:
        e, turn = episodes[i], turn_of[i]
        cap_of[i] = run.cap(e)
        feed.put(i, run.request(e, turn, seed=_request_seed(run.base_seed, i, turn), max_new_tokens=cap_of[i]))

    def step(i: int, t: _Turn) -> None:
        nonlocal remaining
        e, turn = episodes[i], turn_of[i]
        try:
            t0 = time.perf_counter()
            env_lock = env_locks.get(id(e.env))
            if env_lock is None:
                result = _step_env(e, t, turn)
            else:
                with env_lock:
                    result = _step_env(e, t, turn)
            t1 = time.perf_counter()
            with lock:
                if result is not None:
                    run.end(e, t, result, turn)
                if e.done:
                    remaining -= 1
                    feed.open_keys = remaining
                    if not remaining:
                        feed.close()
                else:
                    turn_of[i] = turn + 1
                    feed_turn(i)
                t2 = time.perf_counter()
                parts["env_step_s"] += t1 - t0
                parts["render_s"] += t2 - t1
                timing["env_s"] += t2 - t0
        except BaseException as ex:  # noqa: BLE001 - raised in the caller's thread below
            failures.append(ex)
            feed.cancel()

    if not live:
        return 0.0, 0, 0.0
    with ThreadPoolExecutor(max_workers=min(MAX_ENV_THREADS, len(live))) as pool:
        def on_output(i: int, out) -> None:
            with lock:
                t0 = time.perf_counter()
                t = run.record(episodes[i], out, cap_of[i], turn_of[i])
                parts["parse_s"] += time.perf_counter() - t0
                timing["env_s"] += time.perf_counter() - t0
            pool.submit(step, i, t)

        t0 = time.perf_counter()
        try:
            with lock:
                for i in live:
                    feed_turn(i)
                feed.open_keys = remaining
            run.backend.serve(feed, run.params, on_output, max_seq_len=run.max_seq_len, slots=len(live))
        except BaseException:
            feed.cancel()
            raise
        finally:
            pool.shutdown(wait=True)
        gen_s = time.perf_counter() - t0
    if failures:
        raise failures[0]
    if remaining:
        raise GymvError(f"the generation backend's session ended with {remaining} episode(s) still waiting for output",
                        fix="a backend's serve must answer every request it takes before returning")
    run.add_backend_timing()
    return gen_s, 1, timing["env_s"]


@dataclass
class _Turn:
    """One model call, recorded: what the model said and where its tokens went."""

    said: ModelTurn
    call: dict
    finish: str
    tokens: list[int]


def _record_turn(e: Episode, out, cap: int, turn: int, *, adapter, tokenizer, fmt) -> _Turn:
    tokens, logprobs = list(out.token_ids[:cap]), list(out.logprobs[:cap])
    cut = len(out.token_ids) > cap  # sampled past this episode's own budget: keep the prefix that fits
    finish = "length" if cut else out.finish_reason
    text = tokenizer.decode(tokens, skip_special_tokens=True) if cut else out.text
    said = parse_turn(text, _call_prefix(e, turn), fmt, e.tools)
    return _Turn(said, _append_model_call(e, tokens, logprobs, turn, adapter=adapter, finish=finish,
                                          stop_reason=out.stop_reason), finish, tokens)


def _end_turn(e: Episode, t: _Turn, result: StepResult, turn: int, *, renderer: ChatRenderer, cache: ImageCache,
              adapter, max_turns: int, max_rollout_tokens: int, max_seq_len: int, max_images: int | None) -> None:
    if t.finish == "length":
        return e.finish("length", truncated=True)
    if e.state.done or result.done:
        return e.finish("stop")
    if turn + 1 >= max_turns:
        return e.finish("max_turns")
    if e.generated >= max_rollout_tokens:
        return e.finish("length", truncated=True)
    _env_turn(e, result, turn, closed=renderer.ends_turn(t.tokens), renderer=renderer, cache=cache, adapter=adapter,
              max_seq_len=max_seq_len, max_images=max_images)


def _call_prefix(e: Episode, turn: int) -> str:
    return f"call_{e.task_index}_{e.sample_index}_{turn}"


def _append_model_call(e: Episode, tokens: list[int], logprobs: list[float], turn: int, *, adapter, finish: str,
                       stop_reason) -> dict:
    """Append one model call's tokens (mask 1); the call's record, which `_step_env` completes.

    Tokens that are image placeholders (or other vision special tokens) raise: a backend must mask them out
    of sampling, and a sequence holding one would make the next forward pass pair images with the wrong spans.
    """
    vision = set(getattr(adapter, "vision_token_ids", ()) or ())
    bad = [t for t in tokens if t in vision]
    if bad:
        raise GymvError(f"the generation backend sampled {len(bad)} vision special token(s) (id {bad[0]}), which would "
                        "break the image placeholder spans of this sequence", where=e.at(turn),
                        fix="mask the adapter's vision_token_ids out of the sampling distribution (the hf backend does)")
    start = len(e.ids)
    e.append_sampled(tokens, logprobs)
    e.turns += 1
    call = {"turn": turn, "prompt_end": start, "generation_start": start, "generation_end": len(e.ids),
            "finish_reason": finish, "stop_reason": stop_reason, "output_index": None}
    e.model_calls.append(call)
    return call


def _step_env(e: Episode, t: _Turn, turn: int) -> StepResult | None:
    """Step the environment with the model's turn; None when that failed (the episode is marked)."""
    first = len(e.state.output)
    try:
        result = e.env.step(e.state, t.said)
    except Exception as ex:  # a tool or env step that crashed: this episode only
        t.call["output_index"] = _model_item_index(e, first, len(t.said.to_items()))
        e.fail(f"environment step failed at turn {turn}: {_describe(ex)}")
        return None
    t.call["output_index"] = _model_item_index(e, first, len(t.said.to_items()))
    return result


def _added_messages(result: StepResult) -> list[tuple[dict, list]]:
    """What the environment added after a model turn, in order: tool results, then follow-up messages."""
    return [tool_message_dict(r) for r in result.tool_results] + [message_dict(m) for m in result.user_messages]


def _env_turn(e: Episode, result: StepResult, turn: int, *, closed: bool, renderer: ChatRenderer, cache: ImageCache,
              adapter, max_seq_len: int, max_images: int | None) -> None:
    """Append what the environment added after model call `turn` (mask 0); its images belong to turn + 1.

    An image that cannot be decoded, or environment text that itself reads as an image placeholder (a tool
    echoing `<image>`), is the environment's fault: this episode is marked, the batch goes on.
    """
    nxt = turn + 1
    text, new_images = renderer.addition(_added_messages(result), turn_closed=closed)
    try:
        decoded = [cache.get(im, where=e.at(nxt)) for im in new_images]
    except ImageError as ex:
        return e.fail(f"environment returned an unusable image at turn {nxt}: {ex}")
    if max_images is not None and len(e.images) + len(decoded) > max_images:
        return e.finish("max_images", truncated=True)
    try:
        ids = adapter.encode_text(text, [p for p, _ in decoded], where=e.at(nxt))
    except GymvError as ex:
        return e.fail(f"the environment's messages at turn {nxt} do not fit their images: {ex.message} "
                      "(does a tool result or follow-up contain image placeholder text?)")
    if len(e.ids) + len(ids) + 1 > max_seq_len:
        return e.finish("length", truncated=True)
    e.append_inserted(ids, decoded, nxt)


def _score(e: Episode, weights_version: int) -> Trajectory:
    traj = e.trajectory(weights_version)
    if e.error is not None:
        return traj
    try:
        s = e.env.score(e.state)
    except RowError as ex:
        raise RowError(ex.message, where=e.where, fix=ex.fix) from None
    except Exception as ex:
        traj.error, traj.finish_reason = f"environment scoring failed: {_describe(ex)}", "error"
        return traj
    reward = float(s.reward)
    if not math.isfinite(reward):
        traj.error, traj.finish_reason = f"environment returned a non-finite reward {reward}", "error"
        return traj
    traj.reward, traj.extras, traj.failure_reason = reward, dict(s.extras), s.failure_reason
    return traj


def build_sft_sample(env: Environment, row: dict, adapter, tokenizer, chat_template: str | None, *, max_seq_len: int,
                     task_index: int = 0, max_image_pixels: int | None = None, source: str | None = None,
                     image_cache: ImageCache | None = None, chat_template_kwargs: dict | None = None,
                     tool_call_format: str | None = None) -> Trajectory:
    """A supervised sample: the row's gold episode laid out token for token as the agent loop would.

    The prompt is rendered as a rollout's turn 0. Each of `env.gold_turns(row)` is rendered as the template
    writes that assistant turn after the conversation so far (mask 1, end-of-turn token included, logprobs
    0), read back with the loop's parser and stepped; what the environment adds (tool results, follow-ups,
    their images) is appended by the loop's own code (mask 0), until the episode ends. A model that samples
    these assistant tokens in a rollout gets this very sequence. The episode is scored, so `reward` says
    whether the gold episode earns full reward. A sample longer than `max_seq_len` comes back with `error`
    set (it cannot be trained on uncut).
    """
    fmt = get_tool_call_format(tool_call_format)
    renderer = ChatRenderer(tokenizer, chat_template, chat_template_kwargs, tool_call_format=fmt)
    cache = image_cache or ImageCache(max_pixels=max_image_pixels)
    ep = Episode(task_index, 0, row, env, _where(source, task_index), _agent_name(row, env))
    _open(ep)
    _start(ep, renderer, cache, adapter, max_seq_len=max_seq_len, max_images=None)
    if ep.error is not None:
        return _score(ep, 0)
    conversation = [message_dict(m)[0] for m in ep.state.messages]
    golds = env.gold_turns(row)
    for turn, gold in enumerate(golds):
        ids = adapter.encode_text(renderer.assistant(conversation, ep.tools, gold), [], where=ep.at(turn))
        said = parse_turn(tokenizer.decode(ids, skip_special_tokens=True), _call_prefix(ep, turn), fmt, ep.tools)
        call = _append_model_call(ep, ids, [0.0] * len(ids), turn, adapter=adapter, finish="stop", stop_reason=None)
        result = _step_env(ep, _Turn(said, call, "stop", ids), turn)
        if result is None:
            break
        if ep.state.done or result.done:
            ep.finish("stop")
            break
        if turn + 1 >= len(golds):
            ep.finish("max_turns")  # the gold episode ran out while the environment would go on
            break
        added = _added_messages(result)
        conversation += [assistant_dict(said)] + [d for d, _ in added]
        _env_turn(ep, result, turn, closed=True, renderer=renderer, cache=cache, adapter=adapter,
                  max_seq_len=sys.maxsize, max_images=None)
        if ep.done:
            break
    if ep.error is None and len(ep.ids) > max_seq_len:
        ep.fail(f"the SFT sample has {len(ep.ids)} tokens, over max_seq_len {max_seq_len}")
    return _score(ep, 0)
