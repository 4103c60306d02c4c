from kvboost_rag.request.hashing import (
    content_hash,
    content_hash_chain,
    fingerprint_of,
    prefix_hash,
    root_hash,
)


def prefix_hash_chain(fingerprint, chunks):
    keys, parent = [], root_hash(fingerprint)
    for chunk in chunks:
        parent = prefix_hash(parent, chunk)
        keys.append(parent)
    return keys


def test_prefix_chain_depends_on_everything_before():
    a = prefix_hash_chain("fp", [[1, 2], [3, 4]])
    b = prefix_hash_chain("fp", [[9, 2], [3, 4]])
    assert a[1] != b[1]  # same second chunk, different history
    assert a[0] == prefix_hash(root_hash("fp"), [1, 2])
    assert a[1] == prefix_hash(a[0], [3, 4])


def test_prefix_chain_is_namespaced_by_fingerprint():
    assert prefix_hash_chain("model-a", [[1, 2]]) != prefix_hash_chain("model-b", [[1, 2]])


def test_chunk_lengths_are_part_of_the_key():
    assert prefix_hash_chain("fp", [[1, 2, 3]]) != prefix_hash_chain("fp", [[1, 2], [3]])[-1:]


def test_content_hash_is_position_free_and_chained_within_document():
    first = content_hash("fp", [5, 6])
    assert first == content_hash_chain("fp", [[5, 6], [7]])[0]
    assert content_hash("fp", [7], previous=first) == content_hash_chain("fp", [[5, 6], [7]])[1]
    assert content_hash("fp", [7]) != content_hash("fp", [7], previous=first)
    assert content_hash("other", [5, 6]) != first


def test_fingerprint_separates_parts():
    assert fingerprint_of(["ab", "c"]) != fingerprint_of(["a", "bc"])
    assert len(fingerprint_of(["x"])) == 32
