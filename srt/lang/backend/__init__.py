"""Where a frontend program's requests go: a server over HTTP, or an in-process `Engine`."""
