// GET /docs: Swagger UI on this service's /openapi.json. A file of its own, not an inline
// script, so that the page runs under the console's Content-Security-Policy (script-src 'self').
window.ui = SwaggerUIBundle({
  url: "/openapi.json",
  dom_id: "#swagger-ui",
  deepLinking: true,
  presets: [SwaggerUIBundle.presets.apis],
  layout: "BaseLayout",
  validatorUrl: null,
});
