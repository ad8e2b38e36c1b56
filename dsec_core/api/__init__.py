"""The node API: one route table (server, SDK, OpenAPI) and the HTTP transport."""
