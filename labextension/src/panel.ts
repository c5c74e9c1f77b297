// The side panel #vram-magic-panel: every device (total, what the kernels and other processes hold, free) and
// every kernel, most GPU memory first, with its notebook, GPU memory per device, resident memory, the last
// measured cell's categories as a stacked bar in the report's palette, a short history, and interrupt / restart /
// shut down (the last two after a confirmation).

import { Dialog, showDialog } from '@jupyterlab/apputils';
import { Widget } from '@lumino/widgets';

import { basename, formatBytes, minutes, ofTotal } from './format';
import { KernelsModel, gpuBytes } from './model';
import { ICategory, IDevice, IKernel } from './schema';

export const PANEL_ID = 'vram-magic-panel';

export interface IActions {
  interrupt(kernel: IKernel): Promise<unknown>;
  restart(kernel: IKernel): Promise<unknown>;
  shutdown(kernel: IKernel): Promise<unknown>;
  open(kernel: IKernel): void;
}

type Child = Node | string | null | undefined | false;

function h(tag: string, attrs: Record<string, string> = {}, ...children: Child[]): HTMLElement {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === 'class') {
      el.className = v;
    } else {
      el.setAttribute(k, v);
    }
  }
  for (const c of children) {
    if (c !== null && c !== undefined && c !== false) {
      el.append(c);
    }
  }
  return el;
}

const SVG = 'http://www.w3.org/2000/svg';

/** A stacked bar: segments as wide as their bytes out of `scale`, each with its colour and a tooltip. */
function bar(segments: { bytes: number; color: string; label: string; cls?: string }[], scale: number,
             label: string): HTMLElement {
  const el = h('div', { class: 'vram-magic-bar', role: 'img', 'aria-label': label });
  for (const s of segments) {
    if (s.bytes <= 0 || scale <= 0) {
      continue;
    }
    const seg = h('span', { class: `vram-magic-seg ${s.cls ?? ''}`, title: `${s.label} ${formatBytes(s.bytes)}` });
    seg.style.width = `${Math.min(100, (100 * s.bytes) / scale)}%`;
    if (s.color) {
      seg.style.background = s.color;
    }
    el.append(seg);
  }
  return el;
}

/** The last minutes of a kernel's GPU memory (or its RSS where it holds none) as a line. */
function sparkline(kernel: IKernel): HTMLElement | null {
  const hist = kernel.history;
  if (hist.length < 2) {
    return null;
  }
  const useGpu = hist.some(s => s[2] > 0);
  const values = hist.map(s => (useGpu ? s[2] : s[1] ?? 0));
  const t0 = hist[0][0];
  const t1 = hist[hist.length - 1][0];
  const lo = Math.min(...values);
  const hi = Math.max(...values);
  const span = hi - lo || 1;
  const points = hist
    .map((s, i) => {
      const x = t1 > t0 ? ((s[0] - t0) / (t1 - t0)) * 100 : 0;
      const y = 22 - ((values[i] - lo) / span) * 20;
      return `${x.toFixed(2)},${y.toFixed(2)}`;
    })
    .join(' ');
  const what = useGpu ? 'GPU' : 'RAM';
  const text = `${what} over the last ${minutes(t1 - t0)}: ${formatBytes(lo)} – ${formatBytes(hi)}`;
  const svg = document.createElementNS(SVG, 'svg');
  svg.setAttribute('viewBox', '0 0 100 24');
  svg.setAttribute('preserveAspectRatio', 'none');
  svg.setAttribute('class', 'vram-magic-spark');
  svg.setAttribute('aria-hidden', 'true');
  const line = document.createElementNS(SVG, 'polyline');
  line.setAttribute('points', points);
  line.setAttribute('vector-effect', 'non-scaling-stroke');
  svg.append(line);
  return h('div', { class: 'vram-magic-history', title: text }, svg, h('span', { class: 'vram-magic-sub' }, text));
}

function deviceView(d: IDevice): HTMLElement {
  const other = d.other ?? Math.max(0, d.used - d.kernels);
  const label = `GPU ${d.index} ${d.name}: ${formatBytes(d.used)} used of ${formatBytes(d.total)}`;
  const parts = [`kernels ${formatBytes(d.kernels)}`,
    d.other === null ? 'other processes: not known (no per-process figures)' : `other processes ${formatBytes(other)}`,
    `free ${formatBytes(d.free)}`];
  return h('div', { class: 'vram-magic-device' },
    h('div', { class: 'vram-magic-row' },
      h('span', { class: 'vram-magic-name', title: d.uuid }, `GPU ${d.index} · ${d.name}${d.mig ? ' (MIG)' : ''}`),
      h('span', { class: 'vram-magic-num' }, ofTotal(d.used, d.total))),
    bar([{ bytes: d.kernels, color: '', label: 'this server\'s kernels', cls: 'vram-magic-kernels-seg' },
         { bytes: d.other === null ? 0 : other, color: '', label: 'other processes', cls: 'vram-magic-other-seg' }],
        d.total, label),
    h('div', { class: 'vram-magic-sub' }, parts.join(' · ')));
}

/** The bytes of a breakdown: its categories add up to its total. */
function sum(breakdown: Record<string, number>): number {
  return Object.values(breakdown).reduce((s, n) => s + n, 0);
}

function lastCellView(kernel: IKernel, categories: ICategory[]): HTMLElement | null {
  const cell = kernel.vram_magic?.last_cell;
  if (!cell) {
    return kernel.vram_magic
      ? h('div', { class: 'vram-magic-sub' }, 'vram_magic is loaded; no measured cell yet (%%vram)')
      : null;
  }
  const segs = categories.map(c => ({ bytes: cell.after[c.name] ?? 0, color: c.color, label: c.label }));
  const total = sum(cell.after);
  const peak = sum(cell.peak);
  const scale = Math.max(peak, total, 1);
  const name = cell.cell !== null ? `cell [${cell.cell}]` : 'last measured cell';
  const legend = h('ul', { class: 'vram-magic-legend' });
  for (const c of categories) {
    const n = cell.after[c.name] ?? 0;
    if (n > 0) {
      const sw = h('span', { class: 'vram-magic-swatch', 'aria-hidden': 'true' });
      sw.style.background = c.color;
      legend.append(h('li', {}, sw, `${c.label} ${formatBytes(n)}`));
    }
  }
  const flag = cell.oom ? ' · out of memory' : cell.error ? ' · raised' : '';
  return h('div', { class: 'vram-magic-cell' },
    h('div', { class: 'vram-magic-row' },
      h('span', { class: 'vram-magic-sub' }, `${name} on ${cell.device}${flag}`),
      h('span', { class: 'vram-magic-num vram-magic-sub' },
        `${formatBytes(total)} after, peak ${formatBytes(peak)}`)),
    bar(segs, scale, `${name}: ${segs.filter(s => s.bytes > 0).map(s => `${s.label} ${formatBytes(s.bytes)}`)
      .join(', ') || 'nothing'} after the cell`),
    legend);
}

function button(action: string, text: string, kernelId: string, title: string): HTMLElement {
  return h('button', { class: 'vram-magic-button', type: 'button', 'data-action': action,
    'data-kernel-id': kernelId, title }, text);
}

function kernelView(k: IKernel, categories: ICategory[]): HTMLElement {
  const gpu = gpuBytes(k);
  const main = gpu > 0 ? `GPU ${formatBytes(gpu)}` : `RAM ${formatBytes(k.rss)}`;
  const nb = basename(k.path) || `kernel ${k.id.slice(0, 8)}`;
  const facts = [k.name, k.execution_state, k.pid !== null ? `pid ${k.pid}` : null].filter(Boolean).join(' · ');
  // per device, and the RAM beside them; with no GPU memory the headline figure says it all
  const figures = k.gpu.length ? h('ul', { class: 'vram-magic-figures' }) : null;
  for (const g of k.gpu) {
    const dev = g.index !== null ? `GPU ${g.index}` : g.device ?? 'GPU';
    const how = g.source === 'nvml' ? 'its processes, as NVML counts them' : 'reserved by PyTorch (the kernel\'s own figure; the CUDA context is not in it)';
    figures?.append(h('li', { title: how }, `${dev} ${formatBytes(g.used)}${g.source === 'nvml' ? '' : ' reserved'}`));
  }
  figures?.append(h('li', { title: 'resident memory of the kernel and its child processes (RSS)' }, `RAM ${formatBytes(k.rss)}`));
  const name = h('button', { class: 'vram-magic-nb', type: 'button', title: k.path ? `open ${k.path}` : k.id,
    'data-action': 'open', 'data-kernel-id': k.id }, nb);
  const li = h('li', { class: 'vram-magic-kernel', 'data-kernel-id': k.id },
    h('div', { class: 'vram-magic-row' }, name, h('span', { class: 'vram-magic-num vram-magic-size',
      title: gpu > 0 ? 'GPU memory of the kernel, every device together' : 'resident memory of the kernel and its child processes (RSS)' },
    main)),
    h('div', { class: 'vram-magic-sub' }, facts),
    figures,
    lastCellView(k, categories),
    sparkline(k),
    h('div', { class: 'vram-magic-actions' },
      button('interrupt', 'Interrupt', k.id, `interrupt what ${nb} runs`),
      button('restart', 'Restart', k.id, `restart the kernel of ${nb} (frees its memory)`),
      button('shutdown', 'Shut Down', k.id, `shut down the kernel of ${nb} (frees its memory)`)));
  if (k.path) {
    li.setAttribute('data-path', k.path);
  }
  return li;
}

export class KernelsPanel extends Widget {
  constructor(model: KernelsModel, actions: IActions) {
    super();
    this.id = PANEL_ID;
    this.addClass('vram-magic-panel');
    this.title.caption = 'Kernel memory (vram_magic)';
    this._model = model;
    this._actions = actions;
    this.node.addEventListener('click', this._onClick);
    model.changed.connect(this.render, this);
    this.render();
  }

  protected onAfterShow(): void {
    this._model.watch('panel', true);
  }

  protected onAfterHide(): void {
    this._model.watch('panel', false);
  }

  protected onBeforeDetach(): void {
    this._model.watch('panel', false);
  }

  render(): void {
    const focused = document.activeElement as HTMLElement | null;
    const keep = focused && this.node.contains(focused)
      ? [focused.getAttribute('data-kernel-id'), focused.getAttribute('data-action')] : null;
    const data = this._model.data;
    const body = h('div', { class: 'vram-magic-body' });
    const updated = this._model.updated;
    body.append(h('div', { class: 'vram-magic-header' },
      h('h2', {}, 'Kernel memory'),
      h('button', { class: 'vram-magic-button', type: 'button', 'data-action': 'refresh', title: 'ask again now' },
        'Refresh')));
    if (this._model.error) {
      body.append(h('p', { class: 'vram-magic-error', role: 'alert' }, this._model.error));
    }
    if (!data) {
      body.append(h('p', { class: 'vram-magic-sub' }, this._model.error ? '' : 'Loading…'));
    } else {
      const kernels = [...data.kernels].sort((a, b) => gpuBytes(b) - gpuBytes(a) || (b.rss ?? 0) - (a.rss ?? 0));
      body.append(h('p', { class: 'vram-magic-sub' },
        `${kernels.length} kernel${kernels.length === 1 ? '' : 's'}` +
        (updated ? ` · updated ${updated.toLocaleTimeString()}` : '')));
      if (data.devices.length) {
        body.append(h('section', { class: 'vram-magic-devices', 'aria-label': 'GPUs' },
          ...data.devices.map(deviceView)));
      }
      const list = h('ul', { class: 'vram-magic-kernels', 'aria-label': 'kernels, most GPU memory first' });
      for (const k of kernels) {
        list.append(kernelView(k, data.categories));
      }
      body.append(kernels.length ? list : h('p', { class: 'vram-magic-sub' }, 'No kernel is running.'));
      if (data.notes.length) {
        body.append(h('section', { class: 'vram-magic-notes', 'aria-label': 'notes' },
          h('ul', {}, ...data.notes.map(n => h('li', {}, n)))));
      }
    }
    this.node.replaceChildren(body);
    if (keep) {
      const sel = keep[0] ? `[data-kernel-id="${keep[0]}"][data-action="${keep[1]}"]` : `[data-action="${keep[1]}"]`;
      (this.node.querySelector(sel) as HTMLElement | null)?.focus();
    }
  }

  dispose(): void {
    this.node.removeEventListener('click', this._onClick);
    super.dispose();
  }

  private _onClick = (event: MouseEvent): void => {
    const target = (event.target as HTMLElement).closest('[data-action]') as HTMLElement | null;
    if (!target || !this.node.contains(target)) {
      return;
    }
    const action = target.getAttribute('data-action');
    if (action === 'refresh') {
      void this._model.refresh();
      return;
    }
    const kernel = this._model.kernel(target.getAttribute('data-kernel-id'));
    if (kernel) {
      void this._act(action ?? '', kernel);
    }
  };

  private async _act(action: string, kernel: IKernel): Promise<void> {
    const nb = basename(kernel.path) || `kernel ${kernel.id.slice(0, 8)}`;
    const held = [gpuBytes(kernel) > 0 ? `GPU ${formatBytes(gpuBytes(kernel))}` : null,
      `RAM ${formatBytes(kernel.rss)}`].filter(Boolean).join(', ');
    if (action === 'open') {
      this._actions.open(kernel);
      return;
    }
    if (action === 'restart' || action === 'shutdown') {
      const restart = action === 'restart';
      const result = await showDialog({
        title: restart ? `Restart the kernel of ${nb}?` : `Shut down the kernel of ${nb}?`,
        body: `Its variables are lost and the memory it holds (${held}) is freed.` +
          (restart ? ' The notebook keeps a fresh kernel.' : ' The notebook stays open without a kernel.'),
        buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: restart ? 'Restart' : 'Shut Down' })]
      });
      if (!result.button.accept) {
        return;
      }
    }
    try {
      if (action === 'interrupt') {
        await this._actions.interrupt(kernel);
      } else if (action === 'restart') {
        await this._actions.restart(kernel);
      } else if (action === 'shutdown') {
        await this._actions.shutdown(kernel);
      }
    } catch (err) {
      void showDialog({ title: `Could not ${action} the kernel of ${nb}`, body: String(err),
        buttons: [Dialog.okButton()] });
    }
    await this._model.refresh();
  }

  private _model: KernelsModel;
  private _actions: IActions;
}
