"""index.html of a report: header, metric checks, latest values, plots and the rollout viewer.

The page is static and works from file:// (no fetch, no server, no network): rollouts come from data.js,
loaded by a plain <script src>, and are rendered by vanilla JS that only ever sets textContent and
attributes, so model output containing HTML is shown as text.
"""

from __future__ import annotations

import html
import json

_CSS = """
:root { --fg:#1d232a; --muted:#66707a; --line:#dde2e6; --bg:#f6f7f9; --card:#fff; --ok:#1a7f37; --bad:#c62828; --warn:#9a6700; }
* { box-sizing: border-box; }
body { margin:0; font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif; color:var(--fg); background:var(--bg); }
header { padding:16px 24px; background:#20262d; color:#fff; }
header h1 { margin:0 0 4px; font-size:20px; }
header .meta { color:#c4ccd4; font-size:13px; }
main { padding:16px 24px; max-width:1400px; }
section { margin-bottom:28px; }
h2 { font-size:16px; margin:0 0 10px; }
table { border-collapse:collapse; background:var(--card); }
td, th { border:1px solid var(--line); padding:4px 10px; text-align:left; vertical-align:top; }
th { background:#eef1f4; font-weight:600; }
td.num { text-align:right; font-variant-numeric:tabular-nums; }
.pass { color:var(--ok); font-weight:600; } .fail, .error { color:var(--bad); font-weight:600; }
.plots { display:grid; grid-template-columns:repeat(auto-fill,minmax(440px,1fr)); gap:12px; }
.plots figure { margin:0; background:var(--card); border:1px solid var(--line); padding:6px; }
.plots img { width:100%; height:auto; display:block; }
.filters { display:flex; flex-wrap:wrap; gap:12px; align-items:end; background:var(--card); border:1px solid var(--line); padding:10px; margin-bottom:10px; }
.filters label { display:flex; flex-direction:column; font-size:12px; color:var(--muted); gap:2px; }
.filters input, .filters select { font:inherit; padding:3px 6px; width:8em; }
.filters input[type=search] { width:14em; }
#count { color:var(--muted); margin-left:auto; }
.rollout { background:var(--card); border:1px solid var(--line); border-radius:6px; margin-bottom:12px; }
.rollout > summary { padding:8px 12px; cursor:pointer; display:flex; gap:14px; flex-wrap:wrap; align-items:center; }
.rollout > summary .reward { font-weight:700; }
.badge { font-size:12px; padding:1px 7px; border-radius:10px; background:#eef1f4; color:var(--muted); }
.badge.bad { background:#fdecea; color:var(--bad); }
.turn { border-top:1px solid var(--line); padding:8px 12px; }
.turn > .label, .prompt > .label { font-size:12px; color:var(--muted); text-transform:uppercase; letter-spacing:.04em; margin-bottom:4px; }
.entry { margin:6px 0; padding:6px 10px; border-left:3px solid var(--line); }
.entry.user { border-color:#7aa7d6; } .entry.system, .entry.developer { border-color:#b9b9b9; }
.entry.assistant { border-color:#59a96a; } .entry.reasoning { border-color:#c5a3e6; font-style:italic; }
.entry.tool_call { border-color:#e0a040; background:#fff8ec; } .entry.tool_result { border-color:#d08a2b; background:#fdf6ea; }
.entry .who { font-size:12px; font-weight:600; color:var(--muted); }
.entry pre { margin:3px 0; white-space:pre-wrap; word-break:break-word; font:13px/1.4 ui-monospace,SFMono-Regular,Menlo,monospace; }
.entry img { max-width:360px; max-height:360px; border:1px solid var(--line); margin:4px 0; display:block; image-rendering:auto; }
.missing { color:var(--warn); font-size:12px; }
.group { background:var(--card); border:1px solid var(--line); border-radius:6px; margin-bottom:14px; }
.group > summary { padding:8px 12px; cursor:pointer; display:flex; gap:14px; flex-wrap:wrap; align-items:center; background:#eef1f4; border-radius:6px 6px 0 0; }
.group > summary .mean { font-weight:700; }
.group .prompt { padding:8px 12px; }
.group .samples { padding:0 12px 8px; }
.samples .rollout { margin:8px 0; }
.answer { font-variant-numeric:tabular-nums; }
.answer.ok { color:var(--ok); } .answer.wrong { color:var(--bad); }
.adv { font-variant-numeric:tabular-nums; font-weight:600; }
.adv.pos { color:var(--ok); } .adv.neg { color:var(--bad); } .adv.zero { color:var(--muted); }
button { font:inherit; padding:4px 12px; }
.note { color:var(--muted); }
"""

_JS = r"""
(function () {
  const data = window.GYMV_REPORT || {rollouts: []};
  const all = data.rollouts || [];
  const PAGE = 50;
  let shown = PAGE;
  const $ = (id) => document.getElementById(id);
  const el = (tag, cls, text) => {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  };
  const num = (v) => (v === '' || v === null || v === undefined) ? null : Number(v);
  const steps = Array.from(new Set(all.map(r => r.step))).sort((a, b) => b - a);  // newest first
  const stepSel = $('f-step');
  for (const s of steps) { const o = el('option', null, s); o.value = String(s); stepSel.appendChild(o); }

  function matches(r) {
    const split = $('f-split').value, step = stepSel.value;
    const lo = num($('f-rmin').value), hi = num($('f-rmax').value);
    const q = $('f-text').value.trim().toLowerCase();
    if (split && r.split !== split) return false;
    if (step && r.step !== Number(step)) return false;
    if (lo !== null && !(r.reward !== null && r.reward >= lo)) return false;
    if (hi !== null && !(r.reward !== null && r.reward <= hi)) return false;
    if ($('f-tools').checked && !r.entries.some(e => e.kind === 'tool_call')) return false;
    if (q && !JSON.stringify(r.entries).toLowerCase().includes(q)) return false;
    return true;
  }

  function parts(container, ps) {
    for (const p of ps || []) {
      if (p.kind === 'image') {
        if (p.src) {
          const img = el('img'); img.alt = 'image'; img.loading = 'lazy';
          img.addEventListener('load', () => {  // small images (tiny presets) are enlarged, crisply
            const w = img.naturalWidth;
            if (w && w < 160) { img.style.width = (w * Math.ceil(160 / w)) + 'px'; img.style.imageRendering = 'pixelated'; }
          });
          img.src = p.src;
          container.appendChild(img);
        }
        else container.appendChild(el('div', 'missing', p.missing || 'image not shown'));
      } else {
        container.appendChild(el('pre', null, p.text));
      }
    }
  }

  function entry(e) {
    const role = e.kind === 'message' ? e.role : e.kind;
    const box = el('div', 'entry ' + role.replace(/[^a-z_]/gi, ''));
    if (e.kind === 'tool_call') {
      box.appendChild(el('div', 'who', 'tool call → ' + e.name));
      box.appendChild(el('pre', 'args', e.name + '(' + e.arguments + ')'));
    } else if (e.kind === 'tool_result') {
      box.appendChild(el('div', 'who', 'tool result ← ' + (e.name || e.call_id || '?')));
      parts(box, e.parts);
    } else if (e.kind === 'reasoning') {
      box.appendChild(el('div', 'who', 'reasoning'));
      parts(box, e.parts);
    } else {
      box.appendChild(el('div', 'who', role));
      parts(box, e.parts);
    }
    return box;
  }

  function sampleCard(r) {
    const d = el('details', 'rollout');
    d.open = true;
    const s = el('summary');
    s.appendChild(el('span', 'reward', 'reward ' + (r.reward === null ? '—' : r.reward.toFixed(3))));
    if (r.advantage !== null && r.advantage !== undefined) {
      const a = r.advantage;
      s.appendChild(el('span', 'adv ' + (a > 0 ? 'pos' : a < 0 ? 'neg' : 'zero'), 'advantage ' + (a > 0 ? '+' : '') + a.toFixed(3)));
    }
    if (r.rollout !== null && r.rollout !== undefined) s.appendChild(el('span', null, 'sample ' + r.rollout));
    if (r.expected !== null || r.parsed !== null) {
      const ok = r.reward !== null && r.reward >= 1;
      s.appendChild(el('span', 'answer ' + (ok ? 'ok' : 'wrong'), 'expected ' + (r.expected === null ? '—' : r.expected) + ' · parsed ' + (r.parsed === null ? '—' : r.parsed)));
    }
    s.appendChild(el('span', 'badge', r.turns + (r.turns === 1 ? ' turn' : ' turns')));
    if (r.finish) s.appendChild(el('span', 'badge', r.finish));
    if (r.truncated) s.appendChild(el('span', 'badge bad', 'truncated'));
    if (r.failure) s.appendChild(el('span', 'badge', 'why: ' + r.failure));
    if (r.error) s.appendChild(el('span', 'badge bad', 'error: ' + r.error));
    d.appendChild(s);
    let current = null, box = null;
    for (const e of r.entries) {
      if (e.turn === 0) continue;  // the prompt is shown once, on the group
      if (e.turn !== current) {
        current = e.turn;
        box = el('div', 'turn');
        box.appendChild(el('div', 'label', 'turn ' + e.turn));
        d.appendChild(box);
      }
      box.appendChild(entry(e));
    }
    return d;
  }

  function groupCard(g, hits) {
    const d = el('details', 'group');
    d.open = true;
    const s = el('summary');
    s.appendChild(el('span', null, 'step ' + g.step));
    if (g.split === 'val') s.appendChild(el('span', 'badge', 'validation'));
    if (g.task !== null && g.task !== undefined) s.appendChild(el('span', null, 'task ' + g.task));
    if (g.agent) s.appendChild(el('span', 'badge', g.agent));
    s.appendChild(el('span', null, g.samples.length + (g.samples.length === 1 ? ' sample' : ' samples')));
    if (g.reward_mean !== null) s.appendChild(el('span', 'mean', 'mean reward ' + g.reward_mean.toFixed(3)));
    if (g.zero_std) s.appendChild(el('span', 'badge', 'all rewards equal: no learning signal'));
    d.appendChild(s);
    if (g.prompt.length) {
      const p = el('div', 'prompt');
      p.appendChild(el('div', 'label', 'prompt'));
      for (const e of g.prompt) p.appendChild(entry(e));
      d.appendChild(p);
    }
    const list = el('div', 'samples');
    for (const r of hits) list.appendChild(sampleCard(r));
    d.appendChild(list);
    return d;
  }

  const groups = data.groups || all.map((r, i) => ({split: r.split, step: r.step, task: r.task, agent: r.agent,
    prompt: r.entries.filter(e => e.turn === 0), samples: [i], reward_mean: r.reward, zero_std: false}));

  function render() {
    const list = $('rollouts');
    list.replaceChildren();
    if (!all.length) list.appendChild(el('p', 'note', 'No rollouts logged yet.'));
    let total = 0, drawn = 0;
    for (const g of groups) {
      const hits = g.samples.map(i => all[i]).filter(matches);
      if (!hits.length) continue;
      total += hits.length;
      if (drawn >= shown) continue;
      const room = hits.slice(0, shown - drawn);
      drawn += room.length;
      list.appendChild(groupCard(g, room));
    }
    $('count').textContent = total + ' of ' + all.length + ' rollouts' + (total > shown ? ' (showing ' + shown + ')' : '');
    $('more').hidden = total <= shown;
  }

  // Filters live in the address (#split=val&step=3&rmin=1&rmax=&q=&tools=1) so a link reopens the same view.
  const KEYS = {split: 'f-split', step: 'f-step', rmin: 'f-rmin', rmax: 'f-rmax', q: 'f-text'};
  function fromHash() {
    const h = new URLSearchParams(location.hash.slice(1));
    for (const [k, id] of Object.entries(KEYS)) $(id).value = h.get(k) || '';
    $('f-tools').checked = h.get('tools') === '1';
  }
  function toHash() {
    const h = new URLSearchParams();
    for (const [k, id] of Object.entries(KEYS)) if ($(id).value) h.set(k, $(id).value);
    if ($('f-tools').checked) h.set('tools', '1');
    history.replaceState(null, '', h.toString() ? '#' + h.toString() : location.pathname + location.search);
  }
  for (const id of ['f-split', 'f-step', 'f-rmin', 'f-rmax', 'f-text', 'f-tools']) {
    $(id).addEventListener('input', () => { shown = PAGE; toHash(); render(); });
  }
  window.addEventListener('hashchange', () => { fromHash(); shown = PAGE; render(); });
  fromHash();
  $('more').addEventListener('click', () => { shown += PAGE; render(); });
  $('reset').addEventListener('click', () => {
    for (const id of ['f-split', 'f-step', 'f-rmin', 'f-rmax', 'f-text']) $(id).value = '';
    $('f-tools').checked = false; shown = PAGE; toHash(); render();
  });
  render();
})();
"""


def _e(v) -> str:
    return html.escape(str(v), quote=True)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def render_index(*, title: str, meta: list[str], plots: list, checks: list, latest: list[tuple[str, object]],
                 problems: list[str], n_rollouts: int, data_file: str = "data.js",
                 latest_columns: list[str] | None = None) -> str:
    """`latest_columns` (run names) turns `latest` into (metric, [value per run]) rows: runs compared."""
    out = ["<!doctype html>", '<html lang="en"><head><meta charset="utf-8">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           f"<title>{_e(title)} · gymv report</title>", f"<style>{_CSS}</style></head><body>",
           f"<header><h1>{_e(title)}</h1><div class=\"meta\">{' · '.join(_e(m) for m in meta)}</div></header><main>"]
    if problems:
        out.append('<section><h2>Could not read</h2><ul>' + "".join(f"<li>{_e(p)}</li>" for p in problems) + "</ul></section>")
    if checks:
        rows = "".join(
            f'<tr><td><code>{_e(c.text)}</code></td><td class="{_e(c.status)}">{_e(c.status.upper())}</td>'
            f"<td>{_e(c.error or c.observed_text())}</td></tr>" for c in checks)
        out.append('<section id="checks"><h2>Metric checks</h2><table><tr><th>check</th><th>result</th>'
                   f"<th>observed</th></tr>{rows}</table></section>")
    if latest and latest_columns:
        head = "".join(f"<th>{_e(c)}</th>" for c in latest_columns)
        rows = "".join(f'<tr><td>{_e(k)}</td>' + "".join(f'<td class="num">{"—" if v is None else _e(_fmt(v))}</td>' for v in vs)
                       + "</tr>" for k, vs in latest)
        out.append(f'<section id="latest"><h2>Latest values</h2><table><tr><th>metric</th>{head}</tr>{rows}'
                   "</table></section>")
    elif latest:
        rows = "".join(f'<tr><td>{_e(k)}</td><td class="num">{_e(_fmt(v))}</td></tr>' for k, v in latest)
        out.append(f'<section id="latest"><h2>Latest values</h2><table><tr><th>metric</th><th>value</th></tr>{rows}'
                   "</table></section>")
    out.append('<section id="plots"><h2>Metrics</h2>')
    if plots:
        out.append('<div class="plots">' + "".join(
            f'<figure><img src="{_e(p.file)}" alt="{_e(p.title)}"></figure>' for p in plots) + "</div>")
    else:
        out.append('<p class="note">No metrics logged yet.</p>')
    out.append("</section>")
    out.append(f"""<section id="viewer"><h2>Rollouts</h2>
<div class="filters">
  <label>split<select id="f-split"><option value="">all</option><option value="train">train</option><option value="val">validation</option></select></label>
  <label>step<select id="f-step"><option value="">all</option></select></label>
  <label>reward ≥<input id="f-rmin" type="number" step="any"></label>
  <label>reward ≤<input id="f-rmax" type="number" step="any"></label>
  <label>text<input id="f-text" type="search" placeholder="search turns"></label>
  <label><span>tool calls only</span><input id="f-tools" type="checkbox"></label>
  <button id="reset" type="button">reset</button>
  <span id="count"></span>
</div>
<div id="rollouts">{'' if n_rollouts else '<p class="note">No rollouts logged yet.</p>'}</div>
<button id="more" type="button" hidden>show more</button>
</section></main>
<script src="{_e(data_file)}"></script>
<script>{_JS}</script>
</body></html>
""")
    return "\n".join(out)


def render_data(payload: dict) -> str:
    """data.js: the rollouts as a JS assignment (ASCII-only JSON, so no character can end the script early)."""
    return "window.GYMV_REPORT = " + json.dumps(payload, ensure_ascii=True, separators=(",", ":")) + ";\n"
