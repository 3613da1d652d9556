"""The KVSP client library engines embed: lookup, verified retrieval over HTTP and MOQT, publishing."""
