// Byte sizes in binary units with three significant digits, as vram_magic.format_bytes prints them
// ("16.2 MiB", "1.50 KiB", "3.00 GiB"), so the panel and the reports read alike.

const UNITS = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'];

export function formatBytes(n: number | null | undefined): string {
  if (n === null || n === undefined || !Number.isFinite(n)) {
    return '—';
  }
  const sign = n < 0 ? '−' : '';
  let v = Math.abs(n);
  if (v < 1024) {
    return `${sign}${Math.round(v)} B`;
  }
  let i = 0;
  while (v >= 1024 && i < UNITS.length - 1) {
    v /= 1024;
    i += 1;
  }
  // 1023.9 MiB rounds to "1024 MiB": print it as the next unit instead
  if (v >= 1023.995 && i < UNITS.length - 1) {
    v /= 1024;
    i += 1;
  }
  const digits = v >= 100 ? 0 : v >= 10 ? 1 : 2;
  return `${sign}${v.toFixed(digits)} ${UNITS[i]}`;
}

/** "3.2 / 15.9 GiB": a part of a whole, both in GiB with one decimal (the status bar's GPU figure). */
export function ofTotal(used: number, total: number | null): string {
  if (!total) {
    return formatBytes(used);
  }
  const g = (x: number) => (x / 2 ** 30).toFixed(1);
  return `${g(used)} / ${g(total)} GiB`;
}

export function basename(path: string | null): string {
  if (!path) {
    return '';
  }
  const parts = path.split('/');
  return parts[parts.length - 1] || path;
}

export function minutes(seconds: number): string {
  if (seconds < 90) {
    return `${Math.round(seconds)} s`;
  }
  return `${Math.round(seconds / 60)} min`;
}
