"""kvtrace.dashboard: the Streamlit stage-breakdown dashboard. Not yet built."""
