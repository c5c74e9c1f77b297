// The status bar item #vram-magic-status: the current notebook's kernel — on a GPU "GPU 3.2 / 15.9 GiB" (its
// process, of the device's total), on the CPU its resident memory — and a click (or Enter) opens the panel.

import { ISessionContext } from '@jupyterlab/apputils';
import { INotebookTracker } from '@jupyterlab/notebook';
import { Widget } from '@lumino/widgets';

import { basename, formatBytes, ofTotal } from './format';
import { KernelsModel, mainGpu } from './model';
import { IKernel } from './schema';

export const STATUS_ID = 'vram-magic-status';

export function statusText(kernel: IKernel | null): { text: string; title: string } {
  if (kernel === null) {
    return { text: 'Memory …', title: 'The kernel is not listed yet: its memory shows at the next poll' };
  }
  const where = basename(kernel.path) || kernel.id;
  const g = mainGpu(kernel);
  const rss = `resident memory with child processes (RSS) ${formatBytes(kernel.rss)}`;
  if (g !== null && g.used > 0) {
    const dev = g.index !== null ? `GPU ${g.index}` : g.device ?? 'the GPU';
    const how = g.source === 'nvml' ? 'its process, as NVML counts it' : 'reserved by PyTorch, its own figure';
    const text = `GPU ${ofTotal(g.used, g.total)}`;
    return { text, title: `${where}: ${formatBytes(g.used)} on ${dev} (${how}); ${rss}. Click for every kernel.` };
  }
  return { text: `RAM ${formatBytes(kernel.rss)}`, title: `${where}: no GPU memory; ${rss}. Click for every kernel.` };
}

export class StatusItem extends Widget {
  constructor(model: KernelsModel, tracker: INotebookTracker, open: () => void) {
    super({ node: document.createElement('div') });
    this.id = STATUS_ID;
    this.addClass('jp-StatusBar-TextItem');
    this.addClass('vram-magic-status');
    this.node.tabIndex = 0;
    this.node.setAttribute('role', 'button');
    this._model = model;
    this._tracker = tracker;
    this.node.addEventListener('click', open);
    this.node.addEventListener('keydown', (e: KeyboardEvent) => {
      if (e.key === 'Enter' || e.key === ' ') {
        e.preventDefault();
        open();
      }
    });
    model.changed.connect(this._render, this);
    tracker.currentChanged.connect(this._current, this);
    this._current();
  }

  protected onAfterAttach(): void {
    this._model.watch('status', true);
  }

  protected onBeforeDetach(): void {
    this._model.watch('status', false);
  }

  private _current(): void {
    const ctx = this._tracker.currentWidget?.sessionContext;
    if (ctx && ctx !== this._context) {
      this._context?.kernelChanged.disconnect(this._kernelChanged, this);
      ctx.kernelChanged.connect(this._kernelChanged, this);
      this._context = ctx;
    }
    this._render();
  }

  private _kernelChanged(): void {
    this._render();
    void this._model.refresh();
  }

  private _render(): void {
    const id = this._tracker.currentWidget?.sessionContext.session?.kernel?.id;
    if (!id) {
      this.node.textContent = 'No kernel';
      this.node.title = 'This notebook has no kernel running';
      return;
    }
    const kernel = this._model.kernel(id);
    const { text, title } =
      this._model.error && !kernel ? { text: 'Memory ?', title: this._model.error } : statusText(kernel);
    this.node.textContent = text;
    this.node.title = title;
    this.node.setAttribute('aria-label', `Kernel memory: ${text}. Opens the kernel memory panel.`);
  }

  private _model: KernelsModel;
  private _tracker: INotebookTracker;
  private _context: ISessionContext | null = null;
}
