// jupyter-gpumigrate's JupyterLab plugin: the left sidebar panel and the notebook status bar item.
import { ILabShell, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { INotebookTracker } from '@jupyterlab/notebook';
import { IStatusBar } from '@jupyterlab/statusbar';

import { GpuMigratePanel } from './panel';
import { KernelGpuStatus } from './status';
import { GpuMigrateStore } from './store';

const OPEN = 'gpumigrate:open-panel';

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'jupyter-gpumigrate:plugin',
  description: 'Kernels and their GPUs, with migrate, suspend, resume and drain.',
  autoStart: true,
  requires: [ILabShell],
  optional: [INotebookTracker, IStatusBar],
  activate: (
    app: JupyterFrontEnd,
    shell: ILabShell,
    notebooks: INotebookTracker | null,
    statusBar: IStatusBar | null
  ) => {
    const store = new GpuMigrateStore(app.serviceManager, notebooks);
    const panel = new GpuMigratePanel(store);
    shell.add(panel, 'left', { rank: 650 });
    app.commands.addCommand(OPEN, {
      label: 'Show GPU Kernels',
      caption: 'Open the jupyter-gpumigrate panel',
      execute: () => shell.activateById(panel.id)
    });
    if (notebooks && statusBar) {
      const item = new KernelGpuStatus(store, notebooks, () => void app.commands.execute(OPEN));
      statusBar.registerStatusItem('jupyter-gpumigrate:status', {
        item,
        align: 'left',
        rank: 4,
        isActive: () => !!notebooks.currentWidget && shell.currentWidget === notebooks.currentWidget
      });
    }
  }
};

export default plugin;
