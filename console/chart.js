// Deliveries and failures per minute as an inline SVG: two polylines over 60 minutes.

const SVG = 'http://www.w3.org/2000/svg';
const W = 600;
const H = 160;
const PAD = 28;

function el(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

export function perMinuteChart(minutes) {
  const max = Math.max(1, ...minutes.map((m) => Math.max(m.deliveries, m.failures)));
  const x = (i) => PAD + (i * (W - 2 * PAD)) / Math.max(1, minutes.length - 1);
  const y = (v) => H - PAD - (v * (H - 2 * PAD)) / max;
  const svg = el('svg', { viewBox: `0 0 ${W} ${H}`, class: 'chart', id: 'chart', role: 'img' });
  svg.append(el('title', {}, 'Deliveries and failures per minute, last hour'));
  svg.append(el('line', { x1: PAD, y1: H - PAD, x2: W - PAD, y2: H - PAD, class: 'axis' }));
  svg.append(el('line', { x1: PAD, y1: PAD, x2: PAD, y2: H - PAD, class: 'axis' }));
  svg.append(el('text', { x: 2, y: PAD + 4, class: 'label' }, String(max)));
  svg.append(el('text', { x: 2, y: H - PAD + 4, class: 'label' }, '0'));
  svg.append(el('text', { x: PAD, y: H - 8, class: 'label' }, '−60 min'));
  svg.append(el('text', { x: W - PAD - 22, y: H - 8, class: 'label' }, 'now'));
  for (const [key, cls] of [['deliveries', 'line-ok'], ['failures', 'line-fail']]) {
    const points = minutes.map((m, i) => `${x(i).toFixed(1)},${y(m[key]).toFixed(1)}`).join(' ');
    svg.append(el('polyline', { points, class: cls, 'data-series': key }));
  }
  return svg;
}
