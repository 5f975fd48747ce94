"""Decode step time on one core, alone or beside a prefill loop on the other core (journal, Zen 3
tenth session). `interf.py decode` prints [(batch, median ms)] at 384 tokens of context a sequence;
`interf.py prefill N DIR` prefills N-token prompts, chunked, until DIR/prefill.stop exists (it
writes DIR/prefill.ready after loading)."""

import json
import os
import sys
import time

from baton.bench.profile_engine import DecodePoint, PrefillRunner, Prompts, measure_decode
from baton.common.llm import LLM

mode = sys.argv[1]
engine = LLM().engine
engine.warm_up()
prompts = Prompts(int(time.time()) % 1000, 40000)
if mode == "prefill":
    length, folder = int(sys.argv[2]), sys.argv[3]
    runner = PrefillRunner(engine, prompts)
    open(os.path.join(folder, "prefill.ready"), "w").close()
    n = 0
    while not os.path.exists(os.path.join(folder, "prefill.stop")):
        runner.chunked(length)
        n += 1
    print("prefill prompts", n)
else:
    points = [DecodePoint(b, 384) for b in (1, 4, 8, 16)]
    out = measure_decode(engine, points, steps=40, warmup=5, prompts=prompts)
    print(json.dumps([(o["batch"], round(o["ms"], 2)) for o in out]))
