"""Host memory the engine allocates for K/V: one arena class, segments reused, every range
given back by its handle (request buffers) or when its last view goes (stored chunks)."""
