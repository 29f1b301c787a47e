// Typesets the maths pymdownx.arithmatex leaves as \( ... \) and \[ ... \], on every page load
// (Material's instant navigation included): KaTeX is shipped with the site, no CDN.
document$.subscribe(({ body }) => {
  renderMathInElement(body, {
    delimiters: [
      { left: "\\(", right: "\\)", display: false },
      { left: "\\[", right: "\\]", display: true },
    ],
    throwOnError: false,
  });
});
