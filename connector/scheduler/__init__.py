"""The scheduler side: the requests it tracks, the step's lookup batch and its wait, the
request log, the answers it saves, the time its hooks take."""
