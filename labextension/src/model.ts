// The one poll that asks GET {base_url}vram-magic/kernels (its answer's types: ./schema, generated from
// vram_magic/lab/schema.py): every few seconds while the status bar item or the panel is on screen, never while the
// page is hidden.

import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';
import { Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';

import { IGpu, IKernel, IKernelsReply, ROUTE } from './schema';

export const INTERVAL_MS = 5000;

export class KernelsModel {
  constructor(settings: ServerConnection.ISettings) {
    this._settings = settings;
    this._poll = new Poll({
      auto: false,
      factory: () => this._fetch(),
      frequency: { interval: INTERVAL_MS, backoff: true, max: 60 * 1000 },
      name: 'vram-magic:kernels',
      standby: () => (this._watchers.size === 0 ? true : 'when-hidden')
    });
    void this._poll.start();
  }

  get changed(): ISignal<this, void> {
    return this._changed;
  }

  get data(): IKernelsReply | null {
    return this._data;
  }

  get error(): string | null {
    return this._error;
  }

  get updated(): Date | null {
    return this._updated;
  }

  /** A view that is on screen (`on`) or not: the poll runs while at least one is. */
  watch(who: string, on: boolean): void {
    const was = this._watchers.size;
    if (on) {
      this._watchers.add(who);
    } else {
      this._watchers.delete(who);
    }
    if (was === 0 && this._watchers.size > 0) {
      void this.refresh();
    }
  }

  /** Ask now (after an action, when a view appears); the regular interval resumes from here. */
  refresh(): Promise<void> {
    return this._poll.refresh();
  }

  kernel(id: string | null | undefined): IKernel | null {
    if (!id || !this._data) {
      return null;
    }
    return this._data.kernels.find(k => k.id === id) ?? null;
  }

  dispose(): void {
    this._poll.dispose();
    Signal.clearData(this);
  }

  private async _fetch(): Promise<void> {
    const url = URLExt.join(this._settings.baseUrl, ...ROUTE);
    let response: Response;
    try {
      response = await ServerConnection.makeRequest(url, {}, this._settings);
    } catch (err) {
      this._fail(`the server cannot be reached (${String(err)})`);
      throw err;
    }
    if (!response.ok) {
      const why =
        response.status === 404
          ? 'the vram_magic server extension is not running (404): restart the Jupyter server after installing'
          : `the server answered ${response.status} ${response.statusText}`;
      this._fail(why);
      throw new Error(why);
    }
    this._data = (await response.json()) as IKernelsReply;
    this._error = null;
    this._updated = new Date();
    this._changed.emit();
  }

  private _fail(why: string): void {
    this._error = why;
    this._changed.emit();
  }

  private _settings: ServerConnection.ISettings;
  private _poll: Poll;
  private _data: IKernelsReply | null = null;
  private _error: string | null = null;
  private _updated: Date | null = null;
  private _watchers = new Set<string>();
  private _changed = new Signal<this, void>(this);
}

/** The kernel's GPU memory on the device where it holds the most, or null (none, or not known). */
export function mainGpu(kernel: IKernel): IGpu | null {
  let best: IGpu | null = null;
  for (const g of kernel.gpu) {
    if (best === null || g.used > best.used) {
      best = g;
    }
  }
  return best;
}

export function gpuBytes(kernel: IKernel): number {
  return kernel.gpu.reduce((s, g) => s + g.used, 0);
}
