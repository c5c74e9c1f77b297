// What GET {base_url}vram-magic/kernels answers (see vram_magic/lab/collect.py), and the one poll that asks it:
// every few seconds while the status bar item or the panel is on screen, never while the page is hidden.

import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';
import { Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';

export interface IGpu {
  index: number | null; // NVML's device index
  device: string | null; // the kernel's own name for it ("cuda:0"), from its figures
  name: string | null;
  used: number; // bytes: the process's GPU memory (NVML) or the kernel's reserved bytes (its own figures)
  total: number | null;
  allocated?: number;
  source: 'nvml' | 'vram_magic';
}

export interface ILastCell {
  cell: number | null;
  device: string;
  after: Record<string, number>;
  peak: Record<string, number>;
  total: number;
  peak_total: number;
  failed: boolean;
  oom: boolean;
}

export interface IOwnFigures {
  time: number;
  devices: { device: string; uuid: string; allocated: number; reserved: number; total: number }[];
  last_cell: ILastCell | null;
  measured_cells: number;
}

export interface IKernel {
  id: string;
  name: string | null;
  execution_state: string | null;
  session: string | null;
  path: string | null;
  type: string | null;
  pid: number | null;
  pid_source: 'kernel' | 'provisioner' | null;
  local_pid: number | null;
  nspid: number[] | null;
  rss: number | null;
  gpu: IGpu[];
  vram_magic: IOwnFigures | null;
  history: [number, number | null, number][]; // (time s, rss, gpu bytes)
}

export interface IDevice {
  index: number;
  name: string;
  uuid: string;
  total: number;
  used: number;
  free: number;
  mig: boolean;
  processes: number;
  kernels: number;
  other: number | null;
}

export interface ICategory {
  name: string;
  label: string;
  color: string;
}

export interface IKernelsReply {
  kernels: IKernel[];
  devices: IDevice[];
  notes: string[];
  categories: ICategory[];
  server: { pid: number; time: number };
  took_ms: number;
}

export const ROUTE = ['vram-magic', 'kernels'];
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
