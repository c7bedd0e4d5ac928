from tests.sandboxes.test_swebench_hacks import HACKS, _act, _submit, unprotected  # noqa: F401


def test_probe(swe_backend, request, unprotected):
    make, tasks = swe_backend
    hack = HACKS["the code under test leaves a daemon that forges results after pytest"]
    with make() as sandbox:
        _act(sandbox, tasks[0], hack)
        import time; t = time.time()
        graded = _submit(sandbox)
        print('\nSUBMIT', round(time.time() - t, 2))
        print("\nPROTECTED", request.node.callspec.params["swe_backend"], graded.reward, graded.info["grading_tampered"],
              graded.info.get("grading_reasons"), graded.observation.text[:300])
        unprotected(sandbox)
        _act(sandbox, tasks[0], hack)
        t = time.time()
        control = _submit(sandbox)
        print('CSUBMIT', round(time.time() - t, 2))
        print("CONTROL", control.reward, control.observation.text[:200])
