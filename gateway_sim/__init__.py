"""A scriptable LLM gateway simulator speaking every wire format the server uses; the labelled demo
and the tests' gateway. The app imports it only in demo mode.
"""
