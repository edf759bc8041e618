"""pdserve: disaggregated prefill/decode LLM serving.

The offline API mirrors vLLM's::

    from pdserve import LLM, SamplingParams
    llm = LLM(model="default")
    print(llm.generate(["Hello"], SamplingParams(max_tokens=32))[0].outputs[0].text)
"""

from pdserve.llm import LLM
from pdserve.outputs import CompletionOutput, RequestOutput
from pdserve.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
