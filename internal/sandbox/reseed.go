package sandbox

// ReseedCell runs in the kernel of every restored box: boxes restored from
// one checkpoint share their memory, so the random generators seeded while
// the template imported its libraries would draw the same numbers in every
// box. It runs in a namespace of its own and leaves no names behind.
// (Python's str hash seed stays shared; it cannot change in a live process.)
const ReseedCell = `exec("""
import sys
r = sys.modules.get("random")
if r is not None:
    r.seed()
np = sys.modules.get("numpy")
if np is not None:
    np.random.seed()
tf = sys.modules.get("tempfile")
if tf is not None:
    tf._name_sequence = None
""", {})`
