//! Which conversation a request belongs to: an explicit header wins; otherwise the session whose last
//! raw request plus its answer this request extends (prefix match over message hashes); otherwise a new
//! session with a time-sortable id.
