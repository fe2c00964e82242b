"""Resident memory after loading an artifact or build, and after a 1,400-token chunked perplexity
run through it (for the static prefill/decode pair: weights held once or twice).

    python benchmarks/build_rss.py out/smol out/smol-build-cpu out/smol-build-sa8295p
"""

import subprocess
import sys

CODE = """
import sys
from cabinlm.runtime import open_artifact
from cabinlm.runtime.memory import rss_mb
from cabinlm.runtime.perplexity import chunked_perplexity
before = rss_mb()
dec, tok = open_artifact(sys.argv[1])
loaded = rss_mb()
ids = tok.encode(open("tests/data/prose.txt").read(), add_special_tokens=True)[:1400]
ppl = chunked_perplexity(dec, ids).ppl
print(f"{sys.argv[1]}: {'static pair' if dec.static else 'one graph'}; ppl {ppl:.4f}; "
      f"RSS +{loaded - before:.0f} MB after load, {rss_mb():.0f} MB after the run")
"""
for folder in sys.argv[1:]:  # one process each, so that each RSS is its own
    subprocess.run([sys.executable, "-c", CODE, folder], check=True)
