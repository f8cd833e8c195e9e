//! The HTTP shell: server, upstream client, streaming pass-through, pare's own endpoints and errors.
