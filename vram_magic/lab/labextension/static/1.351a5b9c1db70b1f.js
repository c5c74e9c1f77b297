"use strict";(self.rspackChunkvram_magic=self.rspackChunkvram_magic||[]).push([[1],{21(e,r,a){var t=a(22),n=a.n(t),o=a(23),i=(a.n(o))()(n());i.push([e.id,`/* The status bar item and the side panel. Colours come from JupyterLab's theme variables (light and dark, text
   contrast >= 4.5:1 checked by ci/lab.sh); the category colours are the report's (vram_magic/render/__init__.py),
   sent by the server with each answer. */

.vram-magic-status {
  cursor: pointer;
  white-space: nowrap;
  font-variant-numeric: tabular-nums;
}

.vram-magic-status:focus-visible,
.vram-magic-panel button:focus-visible {
  outline: 2px solid var(--jp-brand-color1, #1976d2);
  outline-offset: 1px;
}

.vram-magic-panel {
  background: var(--jp-layout-color1, #fff);
  color: var(--jp-ui-font-color1, rgba(0, 0, 0, 0.87));
  font-family: var(--jp-ui-font-family, system-ui, sans-serif);
  font-size: var(--jp-ui-font-size1, 13px);
  line-height: 1.35;
  overflow-y: auto;
  min-width: 180px;
}

.vram-magic-body {
  padding: 8px 10px 12px;
}

.vram-magic-header {
  display: flex;
  align-items: center;
  justify-content: space-between;
  gap: 8px;
}

.vram-magic-header h2 {
  font-size: var(--jp-ui-font-size2, 14px);
  font-weight: 600;
  margin: 0;
}

.vram-magic-panel .vram-magic-sub {
  color: var(--jp-ui-font-color2, rgba(0, 0, 0, 0.6));
}

.vram-magic-panel p {
  margin: 4px 0 8px;
}

.vram-magic-error {
  color: var(--jp-ui-font-color1, inherit);
  border-left: 3px solid var(--jp-error-color1, #d32f2f);
  padding-left: 6px;
}

.vram-magic-row {
  display: flex;
  flex-wrap: wrap;
  align-items: baseline;
  justify-content: space-between;
  column-gap: 8px;
  min-width: 0;
}

.vram-magic-num {
  font-variant-numeric: tabular-nums;
  white-space: nowrap;
}

.vram-magic-size {
  font-weight: 600;
}

.vram-magic-name {
  font-weight: 600;
  min-width: 0;
  overflow: hidden;
  text-overflow: ellipsis;
  white-space: nowrap;
}

.vram-magic-devices,
.vram-magic-notes {
  margin: 8px 0;
}

.vram-magic-device {
  padding: 6px 0;
  border-bottom: 1px solid var(--jp-border-color2, #e0e0e0);
}

.vram-magic-kernels,
.vram-magic-notes ul,
.vram-magic-figures,
.vram-magic-legend {
  list-style: none;
  margin: 0;
  padding: 0;
}

.vram-magic-kernel {
  padding: 8px 0;
  border-bottom: 1px solid var(--jp-border-color2, #e0e0e0);
}

.vram-magic-panel .vram-magic-nb {
  background: none;
  border: none;
  padding: 0;
  margin: 0;
  font: inherit;
  font-weight: 600;
  color: var(--jp-content-link-color, #0d47a1);
  cursor: pointer;
  text-align: left;
  min-width: 0;
  max-width: 100%;
  overflow: hidden;
  text-overflow: ellipsis;
  white-space: nowrap;
}

.vram-magic-panel .vram-magic-nb:hover {
  text-decoration: underline;
}

.vram-magic-figures {
  display: flex;
  flex-wrap: wrap;
  column-gap: 12px;
  font-variant-numeric: tabular-nums;
}

.vram-magic-figures li,
.vram-magic-legend li {
  white-space: nowrap;
}

.vram-magic-cell {
  margin-top: 4px;
}

.vram-magic-bar {
  display: flex;
  height: 10px;
  margin: 3px 0;
  overflow: hidden;
  background: rgba(128, 128, 128, 0.14);
  border: 1px solid rgba(128, 128, 128, 0.55);
  border-radius: 2px;
}

.vram-magic-seg {
  display: block;
  height: 100%;
  flex: none;
}

.vram-magic-kernels-seg {
  background: var(--jp-brand-color1, #1976d2);
}

.vram-magic-other-seg {
  background: rgba(128, 128, 128, 0.75);
}

.vram-magic-legend {
  display: flex;
  flex-wrap: wrap;
  column-gap: 10px;
  font-size: var(--jp-ui-font-size0, 11px);
}

.vram-magic-swatch {
  display: inline-block;
  width: 0.8em;
  height: 0.8em;
  margin-right: 4px;
  vertical-align: -0.05em;
  border-radius: 1px;
}

.vram-magic-history {
  display: flex;
  align-items: center;
  gap: 6px;
  margin-top: 4px;
  font-size: var(--jp-ui-font-size0, 11px);
}

.vram-magic-spark {
  flex: 0 0 80px;
  width: 80px;
  height: 20px;
  border-bottom: 1px solid rgba(128, 128, 128, 0.55);
}

.vram-magic-spark polyline {
  fill: none;
  stroke: var(--jp-brand-color1, #1976d2);
  stroke-width: 1.5px;
}

.vram-magic-actions {
  display: flex;
  flex-wrap: wrap;
  gap: 6px;
  margin-top: 6px;
}

.vram-magic-panel .vram-magic-button {
  background: var(--jp-layout-color2, #eee);
  color: var(--jp-ui-font-color1, rgba(0, 0, 0, 0.87));
  border: 1px solid var(--jp-border-color1, #bdbdbd);
  border-radius: 2px;
  padding: 2px 8px;
  font: inherit;
  cursor: pointer;
}

.vram-magic-panel .vram-magic-button:hover {
  background: var(--jp-layout-color3, #ddd);
}

.vram-magic-notes li {
  margin: 4px 0;
  padding-left: 6px;
  border-left: 3px solid var(--jp-warn-color1, #f57c00);
}
`,""]),a.d(r,{},{A:i})},23(e){e.exports=function(e){var r=[];return r.toString=function(){return this.map(function(r){var a="",t=void 0!==r[5];return r[4]&&(a+="@supports (".concat(r[4],") {")),r[2]&&(a+="@media ".concat(r[2]," {")),t&&(a+="@layer".concat(r[5].length>0?" ".concat(r[5]):""," {")),a+=e(r),t&&(a+="}"),r[2]&&(a+="}"),r[4]&&(a+="}"),a}).join("")},r.i=function(e,a,t,n,o){"string"==typeof e&&(e=[[null,e,void 0]]);var i={};if(t)for(var c=0;c<this.length;c++){var p=this[c][0];null!=p&&(i[p]=!0)}for(var s=0;s<e.length;s++){var l=[].concat(e[s]);t&&i[l[0]]||(void 0!==o&&(void 0===l[5]||(l[1]="@layer".concat(l[5].length>0?" ".concat(l[5]):""," {").concat(l[1],"}")),l[5]=o),a&&(l[2]&&(l[1]="@media ".concat(l[2]," {").concat(l[1],"}")),l[2]=a),n&&(l[4]?(l[1]="@supports (".concat(l[4],") {").concat(l[1],"}"),l[4]=n):l[4]="".concat(n)),r.push(l))}},r}},22(e){e.exports=function(e){return e[1]}},15(e){var r=[];function a(e){for(var a=-1,t=0;t<r.length;t++)if(r[t].identifier===e){a=t;break}return a}function t(e,t){for(var n={},o=[],i=0;i<e.length;i++){var c=e[i],p=t.base?c[0]+t.base:c[0],s=n[p]||0,l="".concat(p," ").concat(s);n[p]=s+1;var m=a(l),d={css:c[1],media:c[2],sourceMap:c[3],supports:c[4],layer:c[5]};if(-1!==m)r[m].references++,r[m].updater(d);else{var u=function(e,r){var a=r.domAPI(r);return a.update(e),function(r){r?(r.css!==e.css||r.media!==e.media||r.sourceMap!==e.sourceMap||r.supports!==e.supports||r.layer!==e.layer)&&a.update(e=r):a.remove()}}(d,t);t.byIndex=i,r.splice(i,0,{identifier:l,updater:u,references:1})}o.push(l)}return o}e.exports=function(e,n){var o=t(e=e||[],n=n||{});return function(e){e=e||[];for(var i=0;i<o.length;i++){var c=a(o[i]);r[c].references--}for(var p=t(e,n),s=0;s<o.length;s++){var l=a(o[s]);0===r[l].references&&(r[l].updater(),r.splice(l,1))}o=p}}},17(e){var r={};e.exports=function(e,a){var t=function(e){if(void 0===r[e]){var a=document.querySelector(e);if(window.HTMLIFrameElement&&a instanceof window.HTMLIFrameElement)try{a=a.contentDocument.head}catch(e){a=null}r[e]=a}return r[e]}(e);if(!t)throw Error("Couldn't find a style target. This probably means that the value for the 'insert' parameter is invalid.");t.appendChild(a)}},19(e){e.exports=function(e){var r=document.createElement("style");return e.setAttributes(r,e.attributes),e.insert(r,e.options),r}},18(e,r,a){e.exports=function(e){var r=a.nc;r&&e.setAttribute("nonce",r)}},16(e){e.exports=function(e){if("u"<typeof document)return{update:function(){},remove:function(){}};var r=e.insertStyleElement(e);return{update:function(a){var t,n,o;t="",a.supports&&(t+="@supports (".concat(a.supports,") {")),a.media&&(t+="@media ".concat(a.media," {")),(n=void 0!==a.layer)&&(t+="@layer".concat(a.layer.length>0?" ".concat(a.layer):""," {")),t+=a.css,n&&(t+="}"),a.media&&(t+="}"),a.supports&&(t+="}"),(o=a.sourceMap)&&"u">typeof btoa&&(t+="\n/*# sourceMappingURL=data:application/json;base64,".concat(btoa(unescape(encodeURIComponent(JSON.stringify(o))))," */")),e.styleTagTransform(t,r,e.options)},remove:function(){var e;null===(e=r).parentNode||e.parentNode.removeChild(e)}}}},20(e){e.exports=function(e,r){if(r.styleSheet)r.styleSheet.cssText=e;else{for(;r.firstChild;)r.removeChild(r.firstChild);r.appendChild(document.createTextNode(e))}}},14(e,r,a){var t=a(15),n=a.n(t),o=a(16),i=a.n(o),c=a(17),p=a.n(c),s=a(18),l=a.n(s),m=a(19),d=a.n(m),u=a(20),g=a.n(u),v=a(21),f={};f.styleTagTransform=g(),f.setAttributes=l(),f.insert=p().bind(null,"head"),f.domAPI=i(),f.insertStyleElement=d(),n()(v.A,f),v.A&&v.A.locals&&v.A.locals}}]);