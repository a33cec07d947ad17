"""baton.runtime.retain_host_memory: freed host memory is reused instead of being unmapped and
page-faulted in again (what XLA:CPU's per-call buffers otherwise pay; see baton.jit)."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import resource, numpy as np
    from baton import runtime

    def faults(n=6, elems=12 << 20):  # 48 MiB blocks, allocated, written and freed
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(n):
            x = np.empty(elems, np.float32)
            x.fill(1.0)
            del x
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0

    faults(1)
    before = faults()
    ok = runtime.retain_host_memory()
    faults(1)
    after = faults()
    print(ok, before, after)
""")


def test_retained_memory_is_not_faulted_in_again():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    ok, before, after = out.stdout.split()
    assert ok == "True"
    # glibc's default maps and unmaps each 48 MiB block, so its pages fault in every time (at
    # least 24 per block even with 2 MiB transparent huge pages; ~500 seen here).
    assert int(before) >= 6 * 24, out.stdout
    assert int(after) <= int(before) // 10, out.stdout
