import { LabIcon } from '@jupyterlab/ui-components';

// A chip with pins: our own drawing, coloured by the theme's icon colour.
const svg = `<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">
  <g class="jp-icon3" fill="#616161">
    <path d="M7 7h10v10H7z" fill-opacity="0.35"/>
    <path d="M6 5h12a1 1 0 0 1 1 1v12a1 1 0 0 1-1 1H6a1 1 0 0 1-1-1V6a1 1 0 0 1 1-1zm1 2v10h10V7z"/>
    <path d="M8 2h2v3H8zm6 0h2v3h-2zM8 19h2v3H8zm6 0h2v3h-2zM2 8h3v2H2zm0 6h3v2H2zm17-6h3v2h-3zm0 6h3v2h-3z"/>
  </g>
</svg>`;

export const gpuIcon = new LabIcon({ name: 'jupyter-gpumigrate:gpu', svgstr: svg });
