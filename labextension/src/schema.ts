// The JSON of vram_magic's JupyterLab extension, generated from vram_magic/lab/schema.py by
// scripts/lab_types.py: edit the schema and run the script, not this file.
export const FORMAT = 2; // of the figures file: a server reads the files of its own format only
export const ROUTE = ['vram-magic', 'kernels']; // the route's path under the server's base URL

/** A CUDA device that has a context in the kernel, as the kernel's PyTorch counts it. */
export interface IOwnDevice {
  device: string; // the kernel's name for it ("cuda:0")
  uuid: string; // PyTorch's uuid of the device ("" where it has none)
  allocated: number; // bytes in tensors
  reserved: number; // bytes the caching allocator holds
  total: number;
}

/** The state at a cell's out-of-memory failure. */
export interface ICellOom {
  message: string;
  requested: number | null;
  capacity: number | null;
  live: Record<string, number>; // bytes per category alive then
  holders: [string, number][]; // (variable, bytes)
  site: [string, number, string][]; // (file, line, function) of the failing request
  phase: string;
}

/** The last measured cell: these fields of vram_magic.ranks.payload.report_to_dict(report, detail=False). */
export interface ILastCell {
  cell: number | null;
  device: string;
  after: Record<string, number>; // bytes per category after the cell; they add up to its total
  peak: Record<string, number>; // bytes per category at the cell's peak
  wall_time: number; // seconds
  error: string | null; // what the cell raised
  oom: ICellOom | null;
}

/** A kernel's own figures: the file it writes while vram_magic is loaded. */
export interface IFigures {
  format: number;
  pid: number;
  kernel_id: string | null;
  notebook: string | null;
  time: number; // when a figure last changed (seconds since the epoch)
  devices: IOwnDevice[];
  last_cell: ILastCell | null;
  measured_cells: number;
}

/** A kernel's memory on one GPU. */
export interface IGpu {
  index: number | null; // NVML's device index
  device: string | null; // the kernel's own name for it ("cuda:0"), from its figures
  name: string | null;
  used: number; // bytes: the process's GPU memory (NVML) or the kernel's reserved bytes (its own figures)
  total: number | null;
  allocated: number | null; // bytes in tensors, from the kernel's own figures
  source: 'nvml' | 'vram_magic';
}

/** One kernel of the server. */
export interface IKernel {
  id: string;
  name: string | null;
  execution_state: string | null;
  last_activity: string | null; // ISO 8601
  session: string | null;
  path: string | null;
  type: string | null;
  pid: number | null;
  pid_source: 'kernel' | 'provisioner' | null;
  local_pid: number | null; // the pid in the server's pid namespace
  nspid: number[] | null; // the pid in each nested namespace, outermost first
  rss: number | null; // resident bytes of the kernel and its child processes
  gpu: IGpu[];
  vram_magic: IFigures | null; // its own figures, where vram_magic is loaded
  history: [number, number | null, number][]; // (time s, rss, gpu bytes)
}

/** A GPU as NVML sees it, with the kernels' share and the other processes'. */
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
  other: number | null; // unknown where some process has no per-process figure
}

/** A memory category in the reports' order and palette. */
export interface ICategory {
  name: string;
  label: string;
  color: string;
}

/** The server that answered. */
export interface IServer {
  pid: number;
  time: number;
}

/** What `GET {base_url}vram-magic/kernels` answers. */
export interface IKernelsReply {
  kernels: IKernel[];
  devices: IDevice[];
  notes: string[];
  categories: ICategory[];
  server: IServer;
  took_ms: number;
}
