"""merger/mapping/lora"""
