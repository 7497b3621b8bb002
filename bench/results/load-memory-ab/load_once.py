import time, sys, resource, json
t0 = time.perf_counter()
from fastdecode import LLM
t2 = time.perf_counter()
llm = LLM(sys.argv[1], threads=2, speculate="none")
t3 = time.perf_counter()
print(json.dumps({"import_s": round(t2-t0,3), "llm_s": round(t3-t2,3), "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss/1e6,3)}))
llm.close()
