// vram_magic in JupyterLab 4 and Notebook 7: the status bar item (JupyterLab) and the side panel (both), fed by
// the server route GET {base_url}vram-magic/kernels. Nothing here runs code in a kernel; the panel's actions are
// the user's own clicks on interrupt, restart and shut down.

import { ILayoutRestorer, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';
import { IMainMenu } from '@jupyterlab/mainmenu';
import { INotebookTracker } from '@jupyterlab/notebook';
import { KernelAPI } from '@jupyterlab/services';
import { IStatusBar } from '@jupyterlab/statusbar';
import { LabIcon } from '@jupyterlab/ui-components';
import { Signal } from '@lumino/signaling';

import { KernelsModel } from './model';
import { KernelsPanel, PANEL_ID } from './panel';
import { IKernel } from './schema';
import { StatusItem } from './status';

const OPEN = 'vram-magic:open';

const chipIcon = new LabIcon({
  name: 'vram-magic:chip',
  svgstr:
    '<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">' +
    '<g class="jp-icon3" fill="#616161"><path fill-rule="evenodd" d="M5 5h14v14H5zM8 8v8h8V8z"/>' +
    '<path d="M8 1h2v3H8zM14 1h2v3h-2zM8 20h2v3H8zM14 20h2v3h-2zM1 8h3v2H1zM1 14h3v2H1zM20 8h3v2h-3zM20 14h3v2h-3z"/>' +
    '</g></svg>'
});

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'vram-magic:plugin',
  description: "Every kernel's memory: the current one in the status bar, all of them in a side panel.",
  autoStart: true,
  optional: [IStatusBar, INotebookTracker, ILayoutRestorer, ICommandPalette, IMainMenu],
  activate: (
    app: JupyterFrontEnd,
    statusBar: IStatusBar | null,
    tracker: INotebookTracker | null,
    restorer: ILayoutRestorer | null,
    palette: ICommandPalette | null,
    mainMenu: IMainMenu | null
  ) => {
    const services = app.serviceManager;
    const settings = services.serverSettings;
    const model = new KernelsModel(settings);
    const panel = new KernelsPanel(model, {
      interrupt: (k: IKernel) => KernelAPI.interruptKernel(k.id, settings),
      restart: (k: IKernel) => KernelAPI.restartKernel(k.id, settings),
      // a notebook's kernel goes with its session, as the Running panel does it; a bare kernel by itself
      shutdown: (k: IKernel) => (k.session ? services.sessions.shutdown(k.session) : services.kernels.shutdown(k.id)),
      open: (k: IKernel) => {
        if (k.path) {
          void app.commands.execute('docmanager:open', { path: k.path });
        }
      }
    });
    panel.title.icon = chipIcon;
    app.shell.add(panel, 'right', { rank: 650 });
    restorer?.add(panel, PANEL_ID);

    app.commands.addCommand(OPEN, {
      label: 'Kernel Memory',
      caption: "Every kernel's GPU and RAM memory (vram_magic)",
      icon: chipIcon,
      execute: () => {
        app.shell.activateById(panel.id);
        void model.refresh();
      }
    });
    palette?.addItem({ command: OPEN, category: 'Kernel' });
    mainMenu?.viewMenu.addGroup([{ command: OPEN }], 90);

    if (statusBar && tracker) {
      const item = new StatusItem(model, tracker, () => void app.commands.execute(OPEN));
      const active = new Signal<StatusItem, void>(item);
      tracker.currentChanged.connect(() => active.emit());
      statusBar.registerStatusItem('vram-magic:status', {
        item,
        align: 'left',
        rank: 4,
        isActive: () => tracker.currentWidget !== null,
        activeStateChanged: active
      });
    }
  }
};

export default plugin;
