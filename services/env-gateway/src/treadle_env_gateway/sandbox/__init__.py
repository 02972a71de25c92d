"""Run untrusted code: a separate process in its own namespaces, as `nobody`, under limits.
`runner.Sandbox` is the entry point; `bootstrap` runs inside the sandbox."""
